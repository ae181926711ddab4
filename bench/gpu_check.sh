#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md): everything Talaria has to show on one CUDA GPU, in one run
# of at most 8.5 minutes on an H200, written into one results folder.
#
#   bench/gpu_check.sh [--dry-run] RESULTS_DIR
#
# Steps, each under its own time budget (a step past its budget is stopped and marked "timeout";
# the next one still runs):
#   machine            machine.json: GPU, driver, torch, CUDA, the commit
#   equivalence-*      the engine equivalence tests on the device, tiny float64 then float32 models
#                      against the float64 reference (TALARIA_TEST_DEVICE, TALARIA_TEST_DTYPE):
#                      a junit XML and the pytest log each; one GPU, so TP > 1 cases are left out
#   layer-floor        bench/layer_floor.py: bf16 8B-dense, 30B-A3B-MoE, Qwen3.5-122B-A10B (3 Gated
#                      DeltaNet + 1 gated attention) and GLM-5 (2 MLA + sparse-attention indexer, 256
#                      experts) layers, prefill and decode per layer against the HBM-bandwidth floor
#   layer-floor-fp8    the same for the 8B-dense and 30B-A3B shapes with FP8 block-scaled projections
#                      (the packed path: torch._scaled_mm where it runs, else dequantized), on the packed bytes
#   deltanet           bench/deltanet_prefill.py: one Qwen3.5-122B-A10B Gated DeltaNet layer's
#                      8,192-token prefill, chunked against the recurrence (target 5x), and their
#                      float64 agreement
#   switch             bench/switch.py --device cuda: staged and H2D switches, HKVR restores
#   profile-*          `talaria profile` on each layer shape: profiles/<machine>-<shape>-layers.toml
# and summary.json: every step's status, exit code and seconds. The exit code is 1 if any step
# failed or timed out.
#
# --dry-run runs the same steps on the CPU at toy sizes (float32 layers, a fast subset of the
# equivalence tests, --tiny benches, quick profiles): it proves the script, its figures mean nothing.
set -u -o pipefail

usage() { echo "usage: bench/gpu_check.sh [--dry-run] RESULTS_DIR" >&2; exit 2; }
DRY=0
case "${1:-}" in --dry-run) DRY=1; shift ;; -h|--help) usage ;; esac
[ $# -eq 1 ] || usage
OUT=$1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
mkdir -p "$OUT/logs" "$OUT/configs" "$OUT/profiles" || exit 2
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python}
STEPS="$OUT/steps.tsv"
printf 'step\tstatus\texit_code\tseconds\tbudget_s\n' > "$STEPS"

if [ $DRY -eq 1 ]; then
  DEVICE=cpu; TINY=--tiny; QUICK=--quick; REPEATS="--repeats 2"; DELTANET="--tokens 200 --runs 1 --no-gate"
  # a fast subset: one family through batching and prefix reuse, the host KV copy paths
  SELECT="(batched_prompts and llama) or substrate_copies"
  SELECT32="batched_prompts and llama"
  BUDGET_EQ64=120 BUDGET_EQ32=60 BUDGET_LAYERS=60 BUDGET_FP8=60 BUDGET_DELTANET=60 BUDGET_SWITCH=60 BUDGET_PROFILE=60
else
  DEVICE=cuda; TINY=; QUICK=; REPEATS=; DELTANET=
  SELECT="not tp2 and not tp4 and not tp_group"  # one GPU: a TP group of n ranks needs n GPUs
  SELECT32=$SELECT
  # 466 s with the machine step, and at most 5 s more per step to stop one that overran: < 8.5 minutes
  BUDGET_EQ64=120 BUDGET_EQ32=60 BUDGET_LAYERS=65 BUDGET_FP8=30 BUDGET_DELTANET=25 BUDGET_SWITCH=50 BUDGET_PROFILE=48
fi
EQ64="tests/executor/test_engine_equivalence.py tests/executor/test_substrate_equivalence.py
      tests/executor/test_substrate_faults.py tests/executor/test_substrate_copies.py tests/executor/test_sampler.py
      tests/executor/test_moe_equivalence.py tests/executor/test_hybrid_equivalence.py tests/executor/test_deltanet.py
      tests/executor/test_mla_equivalence.py tests/executor/test_quantized_equivalence.py tests/executor/test_quant.py"
EQ32="tests/executor/test_engine_equivalence.py tests/executor/test_moe_equivalence.py"
SHAPES="8b-dense 30b-a3b-moe"

# step NAME BUDGET_S COMMAND...: run it with its output in logs/NAME.log, and record how it went
step() {
  local name=$1 budget=$2; shift 2
  local t0 rc status
  echo "gpu_check: $name (budget ${budget}s)" >&2
  t0=$(date +%s%N)
  # SIGINT first: pytest and the benches stop cleanly and still write what they have
  timeout -s INT -k 5 "$budget" "$@" > "$OUT/logs/$name.log" 2>&1
  rc=$?
  case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$(( ($(date +%s%N) - t0) / 1000000 ))e-3" "$budget" \
    >> "$STEPS"
  echo "gpu_check: $name: $status" >&2
}

step machine 20 "$PY" - "$OUT/machine.json" "$DEVICE" <<'EOF'
import json, platform, subprocess, sys
import torch
out, device = sys.argv[1], sys.argv[2]
def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
cuda = torch.cuda.is_available()
if device == "cuda" and not cuda:
    sys.exit(f"torch {torch.__version__} sees no CUDA device; run on a GPU machine, or pass --dry-run")
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
name = gpus[0] if device == "cuda" else "cpu-dry-run"
info = {"device": device, "machine": name.lower().replace(" ", "-"), "gpus": gpus,
        "gpu_memory_bytes": [torch.cuda.get_device_properties(i).total_memory for i in range(len(gpus))],
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "host": platform.node(), "commit": run("git", "rev-parse", "HEAD"),
        "nvidia_smi": run("nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader")}
json.dump(info, open(out, "w"), indent=2)
print(json.dumps(info, indent=2))
EOF
MACHINE=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['machine'])" "$OUT/machine.json" 2>/dev/null \
          || echo "$DEVICE-unknown")

for dtype in float64 float32; do
  if [ "$dtype" = float64 ]; then files=$EQ64; select=$SELECT; budget=$BUDGET_EQ64
  else files=$EQ32; select=$SELECT32; budget=$BUDGET_EQ32; fi
  existing=$(for f in $files; do [ -e "$f" ] && echo "$f"; done)
  # shellcheck disable=SC2086  # the file list splits on purpose
  step "equivalence-$dtype" "$budget" env TALARIA_TEST_DEVICE="$DEVICE" TALARIA_TEST_DTYPE="$dtype" \
    "$PY" -m pytest -q -p no:cacheprovider -p no:warnings -k "$select" --junitxml "$OUT/equivalence-$dtype.xml" \
    $existing
done

step layer-floor "$BUDGET_LAYERS" "$PY" bench/layer_floor.py --device "$DEVICE" $TINY $REPEATS \
  --json "$OUT/layer_floor.json"
step layer-floor-fp8 "$BUDGET_FP8" "$PY" bench/layer_floor.py --device "$DEVICE" $TINY $REPEATS --fp8 \
  --shapes 8b-dense,30b-a3b-moe --json "$OUT/layer_floor_fp8.json"
# shellcheck disable=SC2086  # the options split on purpose
step deltanet "$BUDGET_DELTANET" "$PY" bench/deltanet_prefill.py --device "$DEVICE" $DELTANET \
  --json "$OUT/deltanet.json"
step switch "$BUDGET_SWITCH" "$PY" bench/switch.py --device "$DEVICE" $TINY --json "$OUT/switch.json"

for shape in $SHAPES; do
  config="$OUT/configs/$MACHINE-$shape.toml"
  "$PY" bench/gpu_shapes.py config "$shape" --device "$DEVICE" $TINY --out "$config"
  step "profile-$shape" "$BUDGET_PROFILE" "$PY" -m talaria.cli.main profile --config "$config" \
    --out "$OUT/profiles" $QUICK
done

"$PY" - "$STEPS" "$OUT/summary.json" "$MACHINE" $DRY <<'EOF'
import csv, json, sys
steps, out, machine, dry = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
rows = list(csv.DictReader(open(steps), delimiter="\t"))
for r in rows:
    r["exit_code"], r["seconds"], r["budget_s"] = int(r["exit_code"]), float(r["seconds"]), int(r["budget_s"])
summary = {"machine": machine, "dry_run": dry, "ok": all(r["status"] == "ok" for r in rows),
           "seconds": round(sum(r["seconds"] for r in rows), 1), "steps": rows}
json.dump(summary, open(out, "w"), indent=2)
print(json.dumps(summary, indent=2))
sys.exit(0 if summary["ok"] else 1)
EOF
