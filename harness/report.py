"""``labrl report RUN_DIR``: PNG plots and a short text summary from a run's JSONL files.

Plots (written to ``RUN_DIR/report/``), every one against the learner step
(``x="time"``: wall-clock minutes of training, monotone across resumes) and
with both axes labelled:

- ``reward.png``: batch reward, batch accuracy and held-out accuracy;
- ``errors.png``: per-step fractions of episodes that ended in env_error,
  verifier_failed or timeout (the env or verifier failed, not the policy);
- ``staleness.png``: histogram of per-token staleness over the whole run;
- ``is_ratio.png``: behaviour-ratio quantiles (q01..q99 as logged by the objective) per step;
- ``masked.png``: masked fractions (corrections' dropped tokens, OPSM's, untrainable
  episodes, zero-variance groups) and clipped fractions (policy clip low / high,
  dual clip) per step;
- ``env_latency.png``: env latency p50 / p90 / p99 per step;
- ``throughput.png``: generated tokens/s and trained samples/s, with the
  learner's and the sampler's busy fractions;
- ``groups.png``: groups kept and groups dropped as all-correct (the policy
  solves the task) or all-wrong (it fails it every time: a class it has
  collapsed, or a task out of reach), cumulative per step;
- ``by_label.png`` (only when the evaluations carry ``by_label``: an env that
  labels its tasks): held-out accuracy per task label, one line per label (the
  ``MAX_LABEL_LINES`` lowest at the last evaluation when there are more);
- ``cascade_budget.png`` (only for a cascade env: ``cascade/<stage>/spent`` in the
  metrics): each stage's spend per step, as a fraction of its budget where it has one.

The summary ends, for labelled runs, with the labels the policy never answered
at the last evaluation (accuracy 0 and named for no task): a policy that has
collapsed those classes onto others, with what it answered instead; for a
cascade env, with one line per stage: spent, of its budget and left, cost per
episode, and the mean rate at which its rule passed episodes on.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from labrl.errors import ConfigError
from labrl.harness.metrics import read_jsonl
from labrl.harness.pipeline.errors_log import FAILED_OUTCOMES

XAxis = Literal["step", "time"]
X_LABELS = {"step": "learner step", "time": "wall-clock of training (min)"}
FRACTION_YLIM = (-0.02, 1.02)  # a fraction axis, with room for lines that sit on 0 or 1
MAX_LABEL_LINES = 12  # more lines than this cannot be told apart on one plot


@dataclass
class Report:
    summary: str
    plots: list[Path] = field(default_factory=list)
    axes: dict[str, tuple[str, str]] = field(default_factory=dict)  # plot name -> (x label, y label)


#: metrics of ``groups.png``: kept, and the two kinds of zero-variance drop (``buffer.constant_kind``)
GROUP_SERIES = {
    "groups/kept_total": "kept",
    "groups/all_correct_total": "dropped all-correct",
    "groups/all_wrong_total": "dropped all-wrong",
}


def monotone_time(times: list[float]) -> list[float]:
    """Wall-clock seconds that never go back: a drop (a resume of a run whose clock restarted at 0,
    before ``time_s`` carried over) continues from the last value seen before it."""
    out, offset, last = [], 0.0, None
    for t in times:
        if last is not None and t + offset < out[-1]:
            offset = out[-1] - t
        out.append(t + offset)
        last = t
    return out


def _x(rows: list[dict], x: XAxis) -> list[float]:
    if x == "step":
        return [float(r["step"]) for r in rows]
    return [t / 60 for t in monotone_time([float(r.get("time_s") or 0.0) for r in rows])]


def _eval_x(evals: list[dict], x: XAxis) -> list[float]:
    """The x of each evaluation: its step, or its wall-clock minutes (monotone across resumes)."""
    if x == "step":
        return [float(e["step"]) for e in evals]
    return [t / 60 for t in monotone_time([float(e.get("time_s") or 0.0) for e in evals])]


def _series(rows: list[dict], key: str, x: XAxis = "step") -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r, xv in zip(rows, _x(rows, x), strict=True):
        v = r.get(key)
        if isinstance(v, int | float) and math.isfinite(v):
            xs.append(xv)
            ys.append(float(v))
    return xs, ys


def error_rates(rows: list[dict]) -> dict[str, float]:
    """Failed episodes / finished episodes over the whole run, per failure outcome."""
    finished = sum(r.get("episodes/finished") or 0 for r in rows)
    out = {}
    for outcome in FAILED_OUTCOMES:
        failed = sum(
            (r.get(f"errors/{outcome}_frac") or 0.0) * (r.get("episodes/finished") or 0) for r in rows
        )
        out[outcome] = failed / finished if finished else 0.0
    return out


def staleness_counts(rows: list[dict]) -> Counter[int]:
    """Trained tokens per staleness (learner versions behind), summed over the steps' histograms."""
    stale: Counter[int] = Counter()
    for r in rows:
        for k, n in (r.get("staleness/hist") or {}).items():
            stale[int(k)] += n
    return stale


def label_accuracy(evals: list[dict], x: XAxis = "step") -> dict[str, tuple[list[float], list[float]]]:
    """Per task label, the (x, held-out accuracy) of every evaluation that saw the label."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for e, xv in zip(evals, _eval_x(evals, x), strict=True):
        for label, cell in (e.get("by_label") or {}).items():
            xs, ys = out.setdefault(label, ([], []))
            xs.append(xv)
            ys.append(float(cell["accuracy"]))
    return out


def never_answered(evaluation: dict) -> dict[str, dict[str, int]]:
    """Labels of ``evaluation`` with accuracy 0 that the policy gave as no task's answer, with what it
    answered on their tasks instead (most frequent first)."""
    by_label = evaluation.get("by_label") or {}
    answered = {a for cell in by_label.values() for a in cell.get("answers", {})}
    return {
        label: dict(sorted(cell.get("answers", {}).items(), key=lambda kv: -kv[1]))
        for label, cell in by_label.items()
        if cell["accuracy"] == 0 and label not in answered
    }


def collapse_line(evals: list[dict]) -> str | None:
    """The summary's line on collapsed labels at the last evaluation with ``by_label``; None without."""
    labelled = [e for e in evals if e.get("by_label")]
    if not labelled:
        return None
    last = labelled[-1]
    lost = never_answered(last)
    if not lost:
        return f"never answered at step {last['step']}: none (every label of {len(last['by_label'])} named)"
    return f"never answered at step {last['step']}: " + ", ".join(
        f"{label} (answered as {', '.join(f'{a} {n}' for a, n in answers.items())})"
        for label, answers in lost.items()
    )


TARGET_ACCURACY = 0.9  # the quickstart's goal, and the GPU config's (docs/gpu.md)


def time_to_accuracy(evals: list[dict], target: float = TARGET_ACCURACY) -> str | None:
    """When held-out accuracy first reached ``target``: step and minutes of training (monotone across
    resumes), or the best evaluation if it never did; None without evaluations."""
    if not evals:
        return None
    minutes = [t / 60 for t in monotone_time([float(e.get("time_s") or 0.0) for e in evals])]
    for e, m in zip(evals, minutes, strict=True):
        if e["accuracy"] >= target:
            return f"held-out accuracy >= {target:g} first at step {e['step']}, {m:.1f} min of training"
    best = max(range(len(evals)), key=lambda i: evals[i]["accuracy"])
    return (
        f"held-out accuracy never >= {target:g}: best {evals[best]['accuracy']:.3f} at step "
        f"{evals[best]['step']}, {minutes[best]:.1f} min of training"
    )


def summarise(rows: list[dict], evals: list[dict]) -> str:
    if not rows:
        return "no learner steps recorded"
    last = rows[-1]
    tail = rows[-max(1, len(rows) // 10) :]
    stale = staleness_counts(rows)
    total_tokens = sum(stale.values())
    mean_stale = sum(k * n for k, n in stale.items()) / total_tokens if total_tokens else 0.0
    lines = [
        f"steps: {last['step']}  mode: {last.get('mode')}  wall: {last['time_s'] / 60:.1f} min",
        f"reward (batch mean): first {rows[0]['reward/mean']:.3f} -> last 10% {sum(r['reward/mean'] for r in tail) / len(tail):.3f}",
        f"staleness: mean {mean_stale:.2f}, max {max(stale) if stale else 0}, limit {last.get('staleness/limit')}, "
        f"episodes over the limit {sum(r.get('staleness/over_max_episodes', 0) for r in rows)} "
        f"(+{sum(r.get('staleness/over_max_replayed_episodes', 0) for r in rows)} replayed after a fault)",
        f"episodes: {last.get('episodes/total')} finished, {last.get('episodes/masked_total')} masked (untrainable); "
        f"groups: {last.get('groups/kept_total')} kept, {last.get('groups/zero_variance_total')} zero-variance dropped"
        + (
            f" ({last['groups/all_correct_total']} all-correct, {last['groups/all_wrong_total']} all-wrong)"
            if "groups/all_wrong_total" in last
            else ""
        ),
        f"throughput: {sum(r.get('throughput/tokens_per_s', 0) for r in rows) / len(rows):.0f} tokens/s mean; "
        f"busy learner {last.get('busy/learner', 0):.2f}, sampler {last.get('busy/sampler', 0):.2f}",
        "failed episodes: " + ", ".join(f"{k} {v:.3f}" for k, v in error_rates(rows).items()),
    ]
    if evals:
        lines.append(
            "held-out accuracy: "
            + ", ".join(f"step {e['step']}: {e['accuracy']:.3f}" for e in evals[:: max(1, len(evals) // 8)])
            + (f", final step {evals[-1]['step']}: {evals[-1]['accuracy']:.3f}" if len(evals) > 1 else "")
        )
    if (reached := time_to_accuracy(evals)) is not None:
        lines.append(reached)
    collapse = collapse_line(evals)
    if collapse is not None:
        lines.append(collapse)
    lines.extend(cascade_lines(rows))
    return "\n".join(lines)


def cascade_stages(rows: list[dict]) -> list[str]:
    """The cascade stages a run's metrics name (``cascade/<stage>/spent``), in first-seen order."""
    seen: dict[str, None] = {}
    for r in rows:
        for key in r:
            if key.startswith("cascade/") and key.endswith("/spent"):
                seen.setdefault(key.split("/")[1], None)
    return list(seen)


def cascade_lines(rows: list[dict]) -> list[str]:
    """One line per cascade stage: spent (of its budget, and what is left), cost per episode, mean pass rate."""
    lines = []
    last = rows[-1]
    for stage in cascade_stages(rows):
        key = f"cascade/{stage}"
        line = f"cascade stage {stage}: spent {last.get(f'{key}/spent', 0.0):.4g}"
        if f"{key}/limit" in last:
            line += f" of {last[f'{key}/limit']:.4g} (left {last[f'{key}/left']:.4g})"
        line += f", {last.get(f'{key}/cost_per_episode', 0.0):.4g} per episode"
        rates = [r[f"{key}/pass_rate"] for r in rows if r.get(f"{key}/pass_rate") is not None]
        if rates:
            line += f", passed on {sum(rates) / len(rates):.3f} (mean over steps)"
        lines.append(line)
    return lines


def write_report(run_dir: str | Path, out: str | Path | None = None, *, x: XAxis = "step") -> Report:
    """Write the plots and ``summary.txt`` into ``out`` (default ``RUN_DIR/report``); ``x`` picks the x axis."""
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

    report = Report(summary="")
    xlabel = X_LABELS[x]

    def save(
        fig,
        ax,
        name: str,
        *,
        title: str,
        ylabel: str,
        xlabel: str = xlabel,
        ylim: tuple[float, float] | None = None,
    ) -> None:
        """Label ``ax``, then write ``fig`` as ``out_dir/name`` and record its axes in the report."""
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.set_title(title)
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        report.plots.append(path)
        report.axes[name.removesuffix(".png")] = (ax.get_xlabel(), ax.get_ylabel())

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(rows, "reward/mean", x), label="batch reward (mean)", alpha=0.6)
    ax.plot(*_series(rows, "reward/accuracy", x), label="batch accuracy", alpha=0.6)
    if evals:
        ax.plot(_eval_x(evals, x), [e["accuracy"] for e in evals], "o-", label="held-out accuracy")
    ax.legend()
    save(fig, ax, "reward.png", title="reward and accuracy", ylabel="reward / accuracy", ylim=FRACTION_YLIM)

    fig, ax = plt.subplots(figsize=(7, 4))
    for outcome in FAILED_OUTCOMES:
        ax.plot(*_series(rows, f"errors/{outcome}_frac", x), label=outcome)
    ax.legend(fontsize=8)
    save(
        fig,
        ax,
        "errors.png",
        title="failed episodes (env / verifier / timeout) per step",
        ylabel="fraction of episodes finished",
        ylim=FRACTION_YLIM,
    )

    stale = staleness_counts(rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    if stale:
        ks = sorted(stale)
        ax.bar(ks, [stale[k] for k in ks])
    save(
        fig,
        ax,
        "staleness.png",
        title="per-token staleness at training",
        ylabel="tokens",
        xlabel="staleness (learner versions)",
    )

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in sorted(k for k in rows[-1] if k.startswith("ratio/q")):
        ax.plot(*_series(rows, key, x), label=key.removeprefix("ratio/"))
    ax.set_yscale("log")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    save(
        fig,
        ax,
        "is_ratio.png",
        title="behaviour IS ratio exp(logp_old - logp_mu): quantiles",
        ylabel="ratio (log scale)",
    )

    fig, ax = plt.subplots(figsize=(7, 4))
    xs, kept = _series(rows, "corrections/kept_frac", x)
    if xs:
        ax.plot(xs, [1 - k for k in kept], label="tokens masked by corrections")
    for key, label in (
        ("opsm/masked_frac", "tokens masked by OPSM"),
        ("policy/clip_low_frac", "tokens clipped low"),
        ("policy/clip_high_frac", "tokens clipped high"),
        ("policy/dual_clip_frac", "tokens dual-clipped"),
    ):
        xs, ys = _series(rows, key, x)
        if xs and any(ys):
            ax.plot(xs, ys, "--", label=label)
    ax.plot(*_series(rows, "episodes/masked_frac", x), label="episodes untrainable (cumulative)")
    xs, zv = _series(rows, "groups/zero_variance_total", x)
    _, added = _series(rows, "groups/kept_total", x)
    if xs:
        ax.plot(
            xs,
            [z / max(1.0, z + a) for z, a in zip(zv, added, strict=True)],
            label="groups zero-variance (cumulative)",
        )
    ax.legend(fontsize=8)
    save(fig, ax, "masked.png", title="masked and clipped fractions", ylabel="fraction", ylim=FRACTION_YLIM)

    fig, ax = plt.subplots(figsize=(7, 4))
    for q in ("p50", "p90", "p99"):
        ax.plot(*_series(rows, f"env_latency/{q}", x), label=q)
    ax.legend()
    save(fig, ax, "env_latency.png", title="env latency per episode", ylabel="env latency (s)")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(rows, "throughput/tokens_per_s", x), label="generated tokens/s")
    ax2 = ax.twinx()
    ax2.plot(*_series(rows, "busy/learner", x), "g--", label="learner busy")
    ax2.plot(*_series(rows, "busy/sampler", x), "r--", label="sampler busy")
    ax2.set_ylabel("busy fraction")
    ax2.set_ylim(0, 1.05)
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    save(fig, ax, "throughput.png", title="throughput", ylabel="generated tokens / s")

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in GROUP_SERIES.items():
        if any(key in r for r in rows):  # runs from before the split have no all-correct / all-wrong
            ax.plot(*_series(rows, key, x), label=label)
    ax.legend(fontsize=8)
    save(fig, ax, "groups.png", title="groups kept and dropped (cumulative)", ylabel="groups")

    stages = cascade_stages(rows)
    if stages:
        fig, ax = plt.subplots(figsize=(7, 4))
        for stage in stages:
            xs, spent = _series(rows, f"cascade/{stage}/spent", x)
            limit = rows[-1].get(f"cascade/{stage}/limit")
            ax.plot(
                xs,
                [v / limit for v in spent] if limit else spent,
                label=stage + ("" if limit else " (no budget: spent)"),
            )
        ax.legend(fontsize=8)
        save(
            fig,
            ax,
            "cascade_budget.png",
            title="cascade budget spent",
            ylabel="fraction of the stage's budget",
        )

    per_label = label_accuracy(evals, x)
    if per_label:
        shown = sorted(per_label, key=lambda label: (per_label[label][1][-1], label))[:MAX_LABEL_LINES]
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for label in sorted(shown):
            ax.plot(*per_label[label], "o-", markersize=3, label=label)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        which = "" if len(shown) == len(per_label) else f" ({len(shown)} lowest of {len(per_label)})"
        save(
            fig,
            ax,
            "by_label.png",
            title=f"held-out accuracy per task label{which}",
            ylabel="held-out accuracy",
            ylim=FRACTION_YLIM,
        )

    report.summary = summarise(rows, evals)
    (out_dir / "summary.txt").write_text(report.summary + "\n")
    return report
