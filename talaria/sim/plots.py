"""`talaria sim --plots DIR`: the SCT CDF and the switch latency distribution of every variant, as PNGs.

The paper's Fig. 10 (SCT CDF per configuration) and its switch-path figures, drawn from one
command's runs so the variants share axes. matplotlib renders off-screen (Agg): no display needed.
"""

from __future__ import annotations

from pathlib import Path

from talaria.contracts.vocabulary import SwitchPath
from talaria.sim.simulation import SimResult

PATHS = tuple(p.value for p in SwitchPath)


def write_plots(results: dict[str, SimResult], out_dir: Path) -> list[Path]:
    """Write sct_cdf.png and switch_latency.png into `out_dir`; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        sct = sorted(r.sct_s.values())
        if sct:
            ax.step(sct, [(i + 1) / len(sct) for i in range(len(sct))], where="post", label=name)
    ax.set_xlabel("session completion time (s)")
    ax.set_ylabel("fraction of sessions")
    ax.set_title("SCT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out_dir / "sct_cdf.png"))

    fig, axes = plt.subplots(1, len(PATHS), figsize=(12, 4), sharey=True)
    for ax, path in zip(axes, PATHS):
        for name, r in results.items():
            ms = sorted(s["total_ms"] for s in r.switches if s["path"] == path)
            if ms:
                ax.step(ms, [(i + 1) / len(ms) for i in range(len(ms))], where="post",
                        label=f"{name} ({len(ms)})")
        ax.set_title(path)
        ax.set_xlabel("switch latency (ms)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no switches by this path", ha="center", va="center", transform=ax.transAxes)
    axes[0].set_ylabel("fraction of switches")
    written.append(_save(fig, out_dir / "switch_latency.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
