"""Can this machine run this config: model files, tp against each model's heads, arenas, GPUs, RAM.

`talaria up` runs `check_files` before it starts anything, and `talaria config check --files` runs
it on demand. It reads each model's metadata (no weights), checks tp against its heads, that the
GPUs of cuda instances exist (importing torch only then), that each arena holds its largest model
plus its state slots and `MIN_KV_PAGES` KV pages (sizes from the model's cache layout,
talaria/contracts/kv_layout.py), and that the host memory the ranks hold fits the machine's RAM. It
lives with the node because it asks what the node has — files, devices and memory — where
`talaria.config.loader` checks only the file's structure.
"""

from __future__ import annotations

import math

import psutil

from talaria.config.loader import check_tp, tp_misfits
from talaria.config.schema import DTYPE_BYTES, Device, InstanceConfig, TalariaConfig
from talaria.config.tables import Problems, format_size, one_of, toml_value
from talaria.contracts.arch import ModelArch
from talaria.contracts.kv_layout import kv_layout

MIN_KV_PAGES = 4  # an arena must hold its largest model's weights plus at least this many KV pages


def check_files(cfg: TalariaConfig) -> list[str]:
    """The checks `talaria up` runs before starting anything; informational lines if they pass.

    Reads every model's metadata (no weights), checks tp against each model's heads, that the GPUs
    of cuda instances exist (importing torch only then), that each arena holds its largest model
    plus `MIN_KV_PAGES` KV pages, and the host memory against RAM (`check_host_memory`). Raises
    `ConfigError` listing every problem.
    """
    probs, info = Problems(str(cfg.path) if cfg.path is not None else "<config>"), []
    archs, ratios = _model_archs(cfg, probs, info)
    for inst in cfg.instances:
        where = f"[[instances]] {toml_value(inst.name)}"
        known = {m: archs[m] for m in inst.models if m in archs}
        check_tp(inst, known, where, probs)
        fitting = {m: a for m, a in known.items() if not tp_misfits(inst.tp, a)}
        _check_arena(cfg, inst, fitting, ratios, where, probs, info)
    cuda = [i for i in cfg.instances if i.device is Device.CUDA]
    if cuda:
        _check_cuda(cuda, probs, info)
    if len(archs) == len(cfg.models):  # an unreadable model's size is unknown: its problem comes first
        check_host_memory(cfg, archs, psutil.virtual_memory().total, probs, info, ratios)
    for m in cfg.models:
        if not cfg.instances_serving(m.name):
            info.append(f'note: model "{m.name}" is in [[models]] but no instance serves it')
    probs.raise_if_any()
    return info


def weight_bytes(arch: ModelArch, tp: int, dtype: str, ratio: float = 1.0) -> int:
    """Weight bytes one of `tp` ranks holds: its parameters in `dtype`, times a quantized
    checkpoint's ratio of packed to plain bytes (talaria/models/weight_format.py)."""
    return math.ceil(arch.param_count(tp) * DTYPE_BYTES[dtype] * ratio)


def _model_archs(cfg: TalariaConfig, probs: Problems,
                 info: list[str]) -> tuple[dict[str, ModelArch], dict[str, float]]:
    """Each readable model's architecture, and a quantized one's ratio of packed to plain bytes."""
    archs, ratios = {}, {}
    for m in cfg.models:
        from talaria.models.errors import (
            ModelSourceError,  # model readers load on demand
        )
        from talaria.models.source import model_arch, model_weight_format

        base = cfg.path.parent if cfg.path is not None else None
        try:  # synthetic models too: model_arch builds theirs from the shape
            archs[m.name] = model_arch(m, base)
            fmt = model_weight_format(m, base, DTYPE_BYTES[m.dtype])
        except ModelSourceError as e:
            probs.add(f"[[models]] {toml_value(m.name)}", str(e))
            continue
        a = archs[m.name]
        heads = f"{a.num_heads} heads on a latent of {a.kv_lora_rank} + {a.qk_rope_head_dim} (MLA)" if a.is_mla else \
            f"{a.num_heads} query / {a.num_kv_heads} KV heads"
        quantized = ""
        if fmt.kind != "plain":
            ratios[m.name] = fmt.ratio
            quantized = f", weights {fmt.describe()}"
        info.append(f'model "{m.name}": {a.family}, {a.param_count() / 1e6:.1f}M parameters, {heads}, '
                    f"context {a.max_position}{quantized}")
    return archs, ratios


def _check_arena(cfg: TalariaConfig, inst: InstanceConfig, archs: dict[str, ModelArch], ratios: dict[str, float],
                 where: str, probs: Problems, info: list[str]) -> None:
    """The arena must hold the largest model (cold models take turns), its state slots when its
    cache keeps per-sequence state, and a minimal KV pool. Each model's cache sizes on one rank (they
    depend on tp and page_size) become info lines."""
    if not archs:
        return
    need = {}  # model -> (weight bytes, state region bytes, bytes of one KV page) on one rank
    caches = []
    for name, arch in archs.items():
        dtype = cfg.model(name).dtype
        layout = kv_layout(arch, inst.tp, inst.page_size, dtype)
        slots = layout.state_slots(inst.max_running)
        need[name] = (weight_bytes(arch, inst.tp, dtype, ratios.get(name, 1.0)), slots * layout.state_bytes,
                      layout.page_bytes)
        caches.append(f'instance "{inst.name}" model "{name}" cache: {layout.describe()}'
                      + (f"; {slots} state slots" if slots else ""))
        if arch.is_mla and inst.tp > 1 and inst.host_kv_bytes:  # every rank saves its own copy (docs/models.md)
            caches.append(f'instance "{inst.name}" model "{name}": its latent is whole on each of the {inst.tp} '
                          f"ranks, so host KV keeps {inst.tp} copies: {inst.tp * layout.token_bytes} B a token "
                          "on the node")
        if name in ratios:  # a quantized checkpoint: what its packed weights take here
            caches.append(f'instance "{inst.name}" model "{name}" weights: ~{format_size(need[name][0])} per rank, '
                          f"packed ({ratios[name]:.2f}x the plain bytes)")
    name, (weights, states, page) = max(need.items(), key=lambda item: _arena_need(*item[1]))
    kv = MIN_KV_PAGES * page
    if inst.arena_bytes < _arena_need(weights, states, page):
        total = _arena_need(weights, states, page)
        state = f" + {format_size(states)} of state slots" if states else ""
        probs.add(where, f"arena_bytes = {inst.arena_bytes} ({format_size(inst.arena_bytes)}) is "
                  f'too small for model "{name}": one rank needs at least {total} bytes '
                  f"({format_size(total)}): ~{format_size(weights)} of weights at tp = "
                  f"{inst.tp}{state} + {MIN_KV_PAGES} KV pages of {inst.page_size} tokens "
                  f'({format_size(kv)}); use arena_bytes = "{_suggest(total)}" or more')
        return
    pages = (inst.arena_bytes - weights - states) // page
    state = f" and {format_size(states)} of state slots" if states else ""
    info.append(f'instance "{inst.name}": arena {format_size(inst.arena_bytes)} per rank; its '
                f'largest model "{name}" takes ~{format_size(weights)}{state}, leaving room for ~{pages} '
                f"KV pages ({pages * inst.page_size} tokens) less runtime buffers")
    info += caches


def _arena_need(weights: int, states: int, page: int) -> int:
    """Bytes one rank's arena needs for a model: weights, state slots and MIN_KV_PAGES KV pages."""
    return weights + states + MIN_KV_PAGES * page


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
    info.append(f"cuda: {count} x {devices.name}")
    for inst in cuda:
        where, gpus = f"[[instances]] {toml_value(inst.name)}", inst.devices or tuple(range(inst.tp))
        missing = [str(d) for d in gpus if d >= count]
        if inst.tp > count:
            probs.add(where, f"tp = {inst.tp} needs {inst.tp} GPUs but torch finds {count}; lower tp, "
                      "or run on a node with more GPUs")
        elif missing:
            probs.add(where, f"devices = {toml_value(gpus)} names GPU {one_of(missing, 'and')} but torch finds "
                      f"{count} (0 to {count - 1}); without devices, instances take GPUs in config order, one "
                      "per rank: list GPUs that exist and no other instance has, or lower tp")
        else:
            info.append(f'instance "{inst.name}": GPUs {", ".join(map(str, gpus))}')


def check_host_memory(cfg: TalariaConfig, archs: dict[str, ModelArch], ram: int, probs: Problems,
                      info: list[str], ratios: dict[str, float] | None = None) -> None:
    """The host memory every rank holds for its lifetime must fit the machine's `ram`.

    Each rank keeps a host image of every model its instance serves (the switch source; pinned on
    CUDA) and `host_kv_bytes` of host KV slabs (pinned on CUDA); a CPU rank's arena is in RAM too.
    Pinned memory cannot be swapped out: a config past RAM fails at start, or takes the machine down.
    """
    shares = []  # (bytes, instance, what it holds per rank)
    for inst in cfg.instances:
        images = sum(weight_bytes(archs[m], inst.tp, cfg.model(m).dtype, (ratios or {}).get(m, 1.0))
                     for m in inst.models)
        parts = {"weight images": images, "host KV": inst.host_kv_bytes}
        if inst.device is Device.CPU:
            parts["CPU arena"] = inst.arena_bytes
        shares.append((inst.tp * sum(parts.values()), inst, parts))
    total = sum(b for b, _, _ in shares)
    if total <= ram:
        info.append(f"host memory: {format_size(total)} held by the ranks (weight images, host KV, CPU arenas) "
                    f"of {format_size(ram)} RAM")
        return
    lines = []
    for nbytes, inst, parts in sorted(shares, key=lambda s: -s[0]):
        each = " + ".join(f"{what} {format_size(n)}" for what, n in parts.items() if n)
        lines.append(f'"{inst.name}" {inst.tp} rank{"s" if inst.tp > 1 else ""} x ({each}) = {format_size(nbytes)}')
    _, top, parts = max(shares, key=lambda s: s[0])
    lower = {"weight images": "serve fewer or smaller models there (each costs a weight image per rank)",
             "host KV": "lower its host_kv_bytes (per rank)", "CPU arena": "lower its arena_bytes (per rank)"}
    probs.add("[[instances]]", f"the ranks would hold {format_size(total)} of host memory, more than this "
              f"machine's {format_size(ram)} of RAM: {'; '.join(lines)}. Free {format_size(total - ram)} "
              f'or more, starting with the largest share: on "{top.name}", {lower[max(parts, key=parts.get)]}')
