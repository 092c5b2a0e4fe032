"""``labrl report RUN_DIR``: PNG plots and a short text summary from a run's JSONL files.

Plots (written to ``RUN_DIR/report/``):

- ``reward.png``: batch reward and held-out accuracy against wall-clock minutes;
- ``staleness.png``: histogram of per-token staleness over the whole run;
- ``is_ratio.png``: behaviour-ratio quantiles (q01..q99 as logged by the objective) per step;
- ``masked.png``: masked fractions (corrections' dropped tokens, OPSM's, untrainable
  episodes, zero-variance groups) and clipped fractions (policy clip low / high,
  dual clip) per step;
- ``env_latency.png``: env latency p50 / p90 / p99 per step;
- ``throughput.png``: generated tokens/s and trained samples/s, with the
  learner's and the sampler's busy fractions.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from labrl.errors import ConfigError
from labrl.harness.metrics import read_jsonl


@dataclass
class Report:
    summary: str
    plots: list[Path] = field(default_factory=list)


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, int | float) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def summarise(rows: list[dict], evals: list[dict]) -> str:
    if not rows:
        return "no learner steps recorded"
    last = rows[-1]
    tail = rows[-max(1, len(rows) // 10) :]
    stale = Counter()
    for r in rows:
        for k, n in (r.get("staleness/hist") or {}).items():
            stale[int(k)] += n
    total_tokens = sum(stale.values())
    mean_stale = sum(k * n for k, n in stale.items()) / total_tokens if total_tokens else 0.0
    lines = [
        f"steps: {last['step']}  mode: {last.get('mode')}  wall: {last['time_s'] / 60:.1f} min",
        f"reward (batch mean): first {rows[0]['reward/mean']:.3f} -> last 10% {sum(r['reward/mean'] for r in tail) / len(tail):.3f}",
        f"staleness: mean {mean_stale:.2f}, max {max(stale) if stale else 0}, limit {last.get('staleness/limit')}, "
        f"episodes over the limit {sum(r.get('staleness/over_max_episodes', 0) for r in rows)}",
        f"episodes: {last.get('episodes/total')} finished, {last.get('episodes/masked_total')} masked (untrainable); "
        f"groups: {last.get('groups/kept_total')} kept, {last.get('groups/zero_variance_total')} zero-variance dropped",
        f"throughput: {sum(r.get('throughput/tokens_per_s', 0) for r in rows) / len(rows):.0f} tokens/s mean; "
        f"busy learner {last.get('busy/learner', 0):.2f}, sampler {last.get('busy/sampler', 0):.2f}",
    ]
    if evals:
        lines.append(
            "held-out accuracy: "
            + ", ".join(f"step {e['step']}: {e['accuracy']:.3f}" for e in evals[:: max(1, len(evals) // 8)])
            + (f", final step {evals[-1]['step']}: {evals[-1]['accuracy']:.3f}" if len(evals) > 1 else "")
        )
    return "\n".join(lines)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Report:
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"{run_dir} has no metrics.jsonl: is it a labrl run directory?")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    out_dir = Path(out) if out is not None else run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots: list[Path] = []

    def save(fig, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        plots.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [r["time_s"] / 60 for r in rows], [r["reward/mean"] for r in rows], label="batch reward", alpha=0.6
    )
    if evals:
        ax.plot(
            [e["time_s"] / 60 for e in evals], [e["accuracy"] for e in evals], "o-", label="held-out accuracy"
        )
    ax.set_xlabel("wall-clock (min)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    ax.set_title("reward and held-out accuracy")
    save(fig, "reward.png")

    stale = Counter()
    for r in rows:
        for k, n in (r.get("staleness/hist") or {}).items():
            stale[int(k)] += n
    fig, ax = plt.subplots(figsize=(6, 4))
    if stale:
        ks = sorted(stale)
        ax.bar(ks, [stale[k] for k in ks])
    ax.set_xlabel("staleness (learner versions)")
    ax.set_ylabel("tokens")
    ax.set_title("per-token staleness at training")
    save(fig, "staleness.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in sorted(k for k in rows[-1] if k.startswith("ratio/q")):
        ax.plot(*_series(rows, key), label=key.removeprefix("ratio/"))
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_title("behaviour IS ratio exp(logp_old - logp_mu): quantiles")
    ax.legend(fontsize=7)
    save(fig, "is_ratio.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    xs, kept = _series(rows, "corrections/kept_frac")
    if xs:
        ax.plot(xs, [1 - k for k in kept], label="tokens masked by corrections")
    for key, label in (
        ("opsm/masked_frac", "tokens masked by OPSM"),
        ("policy/clip_low_frac", "tokens clipped low"),
        ("policy/clip_high_frac", "tokens clipped high"),
        ("policy/dual_clip_frac", "tokens dual-clipped"),
    ):
        xs, ys = _series(rows, key)
        if xs and any(ys):
            ax.plot(xs, ys, "--", label=label)
    ax.plot(*_series(rows, "episodes/masked_frac"), label="episodes untrainable (cumulative)")
    xs, zv = _series(rows, "groups/zero_variance_total")
    _, added = _series(rows, "groups/kept_total")
    if xs:
        ax.plot(
            xs,
            [z / max(1.0, z + a) for z, a in zip(zv, added, strict=True)],
            label="groups zero-variance (cumulative)",
        )
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
    ax.set_title("masked and clipped fractions")
    save(fig, "masked.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for q in ("p50", "p90", "p99"):
        ax.plot(*_series(rows, f"env_latency/{q}"), label=q)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend()
    ax.set_title("env latency per episode")
    save(fig, "env_latency.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(rows, "throughput/tokens_per_s"), label="generated tokens/s")
    ax.set_xlabel("step")
    ax2 = ax.twinx()
    ax2.plot(*_series(rows, "busy/learner"), "g--", label="learner busy")
    ax2.plot(*_series(rows, "busy/sampler"), "r--", label="sampler busy")
    ax2.set_ylim(0, 1.05)
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    ax.set_title("throughput")
    save(fig, "throughput.png")

    summary = summarise(rows, evals)
    (out_dir / "summary.txt").write_text(summary + "\n")
    return Report(summary=summary, plots=plots)
