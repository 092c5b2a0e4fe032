"""``labrl plan --plot PATH``: one PNG of a planned layout, its staleness histogram and each component's
time-averaged utilisation (learner, sampler KV slots, env slots, driver), as the simulator measured them."""

from __future__ import annotations

from pathlib import Path

from labrl.errors import ConfigError
from labrl.harness.planning.plan import PlannedLayout


def plot_layout(row: PlannedLayout, path: str | Path, *, bound: int) -> Path:
    """Write ``row``'s two panels to ``path`` (PNG); ``bound`` is drawn on the histogram."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib (a labrl dependency): .venv/bin/python -m pip install matplotlib"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim = row.simulated
    fig, (hist, util) = plt.subplots(1, 2, figsize=(11, 4))
    versions = sorted(sim.staleness_hist)
    total = sum(sim.staleness_hist.values()) or 1
    hist.bar(versions, [sim.staleness_hist[v] / total for v in versions], color="tab:blue")
    hist.axvline(bound + 0.5, color="tab:red", linestyle="--", label=f"bound {bound}")
    hist.set_xlabel("staleness (learner versions)")
    hist.set_ylabel("fraction of trained episodes")
    hist.set_title(f"staleness p50 {sim.staleness_p50:g}, p99 {sim.staleness_p99:g}")
    hist.legend()
    names = list(sim.utilisation)
    util.bar(names, [sim.utilisation[n] for n in names], color="tab:green")
    util.set_ylim(0, 1)
    util.set_ylabel("busy fraction (simulated)")
    util.set_title(f"{sim.steps_per_s:.4g} steps/s; binds first: {row.closed.binding}")
    fig.suptitle(" ".join(row.override_args), fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
