"""Reward cascades (issue 30): held-out truth reward per unit of expensive compute, by how the truth is paid for.

Each arm trains ``configs/cascade-synthetic.yaml`` (``synthetic/cascade-v0``) with the benchmark's own
tuning (``TUNING``: targets in the band [0.25, 0.35], truth width 0.5, the proxy's optimum 0.3 above the
truth's and reading 0.1 high, a larger tiny-moe, a longer warm start, RL lr 3e-4 with a KL to the
warm-started policy, 100 sync steps). The warm start answers uniformly in [0, 1] (the env's
``random_action``), so the policy learns by moving its answers onto the truth's optimum (~0.3), the
proxy's alone would pull them to ~0.6: a task a tiny model learns within 100 steps on 2 cores, where
copying the hint of a target anywhere in [0.1, 0.9] took thousands
and the arm's config overrides (``ARMS``), through ``labrl train``'s run API (``runner.train``)::

    python benchmarks/cascade.py --arm always-expensive --seed 0   # one part: results/cascade/ARM_SEED.json
    python benchmarks/cascade.py --arm cascade --seed 1 --set pipeline.total_steps=40
    python benchmarks/cascade.py --merge                           # table, cascade.json, cascade.png

The arms (an arm is only overrides, so a new rule is one more line in ``ARMS``):

- ``always-expensive``: ``cascade.audit_probability=1``: every candidate runs the truth with
  ``q = 1``, so the reward ``r = c + (A/q)(e - c) = e`` is the truth itself;
- ``always-cheap``: the threshold out of reach and the smallest audit the section accepts
  (``MIN_AUDIT_PROBABILITY``, 1e-4; 0 is refused): a candidate reaches the truth only if its audit
  draw ``u < 1e-4`` fires, and otherwise ``r = s_0 = c``, the proxy alone. Each part records how
  many train candidates reached the truth (``train_truth_calls``); 0 means every trained reward
  was the proxy;
- ``cascade``: the proxy screens (``pass_threshold``), the truth scores what passes and an audit
  at ``p`` of the rest;
- ``informative``: the ``Informative`` rule (``informative_z``) passes the members whose group
  advantage sign the truth could flip, ``|c_i - mean c| < z sigma sqrt(1 - 1/n)``, and audits the
  rest at the same ``p``;
- ``learnt-baseline``: no rule passes anything, every candidate is audited at ``p = 0.1``, and the
  unaudited ones are rewarded with the learnt baseline ``b`` (``cascade.control_variate``:
  ``nearest_truths``, the mean truth of the nearest paid candidates of other tasks by the answer's
  offset from the hint), ``r = b + (A / p)(e - b)``;
- ``learnt-baseline-200``: the same for 200 steps (its lr schedule over 200): a gated arm pays
  for the truth on a tenth of its episodes, so it can train longer on the same truth compute.

Every arm sets ``cascade.test_split_at_truth``: the held-out evaluation (``eval.jsonl``) runs the
truth on every test candidate, so its ``reward_mean`` is the held-out truth reward ``mean e``.

Per eval point a part records the held-out truth reward and the expensive compute spent on
training so far: the ledger's (``RUN_DIR/cascade-ledger.sqlite``) charges of the ``truth`` stage
under train-split keys, attributed to the step that trained or dropped their task's episodes
(``episodes.jsonl``). A candidate already in the ledger is not charged again, so the compute is
what a run that caches its verifier pays. It also records the arm's reward fidelity:
``reward_truth_corr``, the Pearson correlation of the arm's reward ``r`` with the truth ``e`` over
``PROBE_SIZE`` fixed (task, answer) pairs (32 tasks, ``group_size`` answers ``hint + U(-0.3, 0.3)``
each, scored as one group), through the arm's env with an in-memory ledger; ``--reprobe`` redoes
it for every part without training.

``--merge`` prints, per arm, the final held-out truth reward (median and range over seeds), the
expensive compute used (median GPU-h) and its ratio to always-expensive's, and the compute at which
the arm's median curve first reaches always-expensive's final median (``reach``), and the goal per
gated arm (``GATED_ARMS``: reach within 25 % of the compute, final above always-cheap's); it writes
``results/cascade.json`` and ``results/cascade.png`` (held-out truth reward vs expensive compute).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _results import RESULTS, pyplot, save_figure  # beside this script

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "cascade-synthetic.yaml"
PARTS = RESULTS / "cascade"
EXPENSIVE_STAGE = "truth"
BASELINE = "always-expensive"
#: the arms that choose where to pay for the truth, each held to the goal
GATED_ARMS = ("cascade", "informative", "learnt-baseline", "learnt-baseline-200")
#: the issue's goal: the cascade reaches the baseline's final reward with at most this share of its compute
GOAL_COMPUTE_SHARE = 0.25
PROBE_SIZE = 256
PROBE_SEED_OFFSET = 9_000_000  # probe tasks far from every run's train seeds (run_seed * 1_000_003 + i)
#: probe pairs scored first, on other tasks, so a rule or baseline that learns from paid values has some
PROBE_WARMUP = 1024
PROBE_WARMUP_CHUNK = 4  # groups scored at once during the warm-up (what they pay teaches the next chunk)

#: the benchmark's own tuning of configs/cascade-synthetic.yaml: learnable in a few minutes on 2 cores
TUNING = [
    "env.options.target_low=0.25", "env.options.target_high=0.35", "env.options.width=0.5",
    "env.options.proxy_shift=0.3", "pipeline.mode=sync", "sampler.max_new_tokens=40",
    "model.overrides.hidden_size=96", "model.overrides.ffn_hidden_size=192",
    "model.overrides.moe_ffn_hidden_size=192",
    "sft.steps=150", "sft.batch_size=16", "sft.lr=3e-3", "sft.schedule=cosine", "sft.num_prompts=512",
    "learner.optimizer.lr=3e-4", "learner.optimizer.warmup_steps=10", "learner.optimizer.schedule=cosine",
    "learner.optimizer.total_steps=100", "learner.micro_batch_size=32", "learner.reference=initial",
    "objective.kl_coef=0.05",
    "pipeline.total_steps=100", "pipeline.batch_groups=8", "pipeline.group_size=8",
    "pipeline.max_concurrent_episodes=64", "pipeline.eval_every=20", "pipeline.eval_size=64", "pipeline.eval_temperature=1.0",
    "pipeline.progress=false", "cascade.test_split_at_truth=true", "cascade.budgets={}",
]  # fmt: skip

LEARNT_BASELINE = [
    "env.options.pass_threshold=1.0e+9",
    "cascade.audit_probability=0.1",
    "cascade.control_variate.kind=nearest_truths",
]
ARMS: dict[str, list[str]] = {
    "always-expensive": ["cascade.audit_probability=1.0"],
    "always-cheap": ["env.options.pass_threshold=1.0e+9", "cascade.audit_probability=1.0e-4"],
    "cascade": ["env.options.pass_threshold=0.9", "cascade.audit_probability=0.1"],
    "informative": ["env.options.informative_z=0.1", "cascade.audit_probability=0.1"],
    "learnt-baseline": LEARNT_BASELINE,
    # the same, twice the steps (its lr schedule over 200): the truth it pays is what is compared
    "learnt-baseline-200": [
        *LEARNT_BASELINE,
        "pipeline.total_steps=200",
        "learner.optimizer.total_steps=200",
    ],
}


def run_overrides(arm: str, seed: int, run_dir: Path, extra: Sequence[str] = ()) -> list[str]:
    """The overrides of one part: tuning, the arm's, its seed and files, then ``extra`` (last wins)."""
    return [
        *TUNING, *ARMS[arm], f"seed={seed}", f"cascade.seed={seed}", f"run_dir={run_dir}",
        f"cascade.ledger_path={run_dir / 'cascade-ledger.sqlite'}", *extra,
    ]  # fmt: skip


def load_arm_config(arm: str, seed: int, run_dir: Path, extra: Sequence[str] = ()) -> Any:
    from labrl.harness.config import load_run_config

    return load_run_config(CONFIG, run_overrides(arm, seed, run_dir, extra))


def task_id_of(key: str) -> tuple[str, str]:
    """``(split, task_id)`` of a ledger key ``env_id/split/seed/task_id/stage/digest`` (the env id has a slash)."""
    parts = key.split("/")
    return parts[-5], parts[-3]


def train_charges(ledger: Path, stage: str = EXPENSIVE_STAGE) -> list[tuple[str, float]]:
    """``(task_id, cost)`` of every train-split charge of ``stage`` in the ledger (none if no stage was paid:
    the ledger is created at the first charge)."""
    if not ledger.exists():
        return []
    with sqlite3.connect(ledger) as conn:
        rows = conn.execute("SELECT key, cost FROM charges WHERE stage = ?", (stage,)).fetchall()
    return [(task, cost) for key, cost in rows for split, task in [task_id_of(key)] if split == "train"]


def first_step_of_tasks(episodes: Path) -> dict[str, int]:
    """Each train task's earliest ``step`` in ``episodes.jsonl`` (the step that trained or dropped it)."""
    first: dict[str, int] = {}
    for line in episodes.read_text().splitlines():
        row = json.loads(line)
        first[row["task_id"]] = min(row["step"], first.get(row["task_id"], row["step"]))
    return first


def learning_curve(
    evals: list[dict[str, Any]], charges: list[tuple[str, float]], first_step: dict[str, int]
) -> list[dict[str, Any]]:
    """Per eval point: held-out truth reward and the expensive compute of the tasks trained by then."""
    curve = []
    for e in evals:
        paid = [cost for task, cost in charges if first_step.get(task, math.inf) <= e["step"]]
        curve.append(
            {
                "step": e["step"],
                "heldout_truth": e["reward_mean"],
                "truth_gpu_h": sum(paid),
                "truth_calls": len(paid),
            }
        )
    return curve


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    """``cov(x, y) / (sd(x) sd(y))``; NaN when either is constant."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


async def reward_fidelity(arm: str, seed: int, size: int = PROBE_SIZE) -> dict[str, float]:
    """The arm's reward ``r`` against the truth ``e`` on fixed (task, answer) pairs, through its env.

    The pairs come in groups of the run's ``group_size`` answers to one task, each group scored as
    one GRPO group (a shared ``GroupGate``), so a rule that decides by the group sees one. First
    ``PROBE_WARMUP`` pairs of other tasks go through the arm's env a few groups at a time, unmeasured:
    what a learning rule (``Informative``'s sigma) or a learnt baseline knows in a run comes from the
    values it paid for before, and a probe scored cold would measure none of it."""
    from labrl.envs import Action
    from labrl.envs.cascade import GroupGate
    from labrl.harness.backends.parts import make_env_factory
    from labrl.harness.rollout.play import join_cascade_group

    # a throwaway run directory, so its ledger (RUN_DIR/cascade-ledger.sqlite when ledger_path is unset)
    # is not the run's spending and leaves nothing behind
    scratch = Path(tempfile.mkdtemp(prefix="cascade-probe-"))
    unset = ["cascade.ledger_path=null"]
    arm_cfg = load_arm_config(arm, seed, scratch / "arm", unset)
    make_arm = make_env_factory(arm_cfg)
    make_truth = make_env_factory(
        load_arm_config(arm, seed, scratch / "truth", [*unset, "cascade.audit_probability=1.0"])
    )
    group = arm_cfg.pipeline.group_size
    rng = random.Random(seed)

    async def score_group(make_env: Any, seed_i: int, texts: list[str]) -> list[float]:
        gate = GroupGate(len(texts))

        async def one(member: int, text: str) -> float:
            try:
                env = make_env()
                join_cascade_group(env, gate, member)
                try:
                    await env.reset(env.make_task("train", seed_i))
                    return float((await env.step(Action(text=text))).reward)
                finally:
                    await env.close()
            finally:
                gate.leave(member)

        return list(await asyncio.gather(*(one(m, t) for m, t in enumerate(texts))))

    tasks_of = make_arm()  # make_task is pure: one env names every probe task

    def probe_groups(first_seed: int, count: int) -> list[tuple[int, list[str]]]:
        groups = []
        for i in range(count):
            hint = tasks_of.make_task("train", first_seed + i).prompt["hint"]
            answers = [min(1.0, max(0.0, hint + rng.uniform(-0.3, 0.3))) for _ in range(group)]
            groups.append((first_seed + i, [f"<answer>{a:.3f}</answer>" for a in answers]))
        return groups

    groups = probe_groups(PROBE_SEED_OFFSET, size // group)
    warmup = probe_groups(PROBE_SEED_OFFSET + 100_000, PROBE_WARMUP // group)
    try:
        for start in range(0, len(warmup), PROBE_WARMUP_CHUNK):
            chunk = warmup[start : start + PROBE_WARMUP_CHUNK]
            await asyncio.gather(*(score_group(make_arm, s, t) for s, t in chunk))
        rewards = [
            r for g in await asyncio.gather(*(score_group(make_arm, s, t) for s, t in groups)) for r in g
        ]
        truths = [
            e for g in await asyncio.gather(*(score_group(make_truth, s, t) for s, t in groups)) for e in g
        ]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "reward_truth_corr": pearson(rewards, truths),
        "reward_minus_truth_mean": statistics.fmean(r - e for r, e in zip(rewards, truths, strict=True)),
        "probe_size": len(rewards),
    }


def reprobe(path: Path) -> None:
    """Recompute the reward-fidelity fields of the part at ``path`` (the probe alone, no training)."""
    part = json.loads(path.read_text())
    part.update(asyncio.run(reward_fidelity(part["arm"], part["seed"])))
    path.write_text(json.dumps(part, indent=2))


def run_part(arm: str, seed: int, extra: Sequence[str], runs: Path, parts: Path) -> Path:
    """Train one (arm, seed) fresh and write ``parts/ARM_SEED.json``; the path written."""
    from labrl.harness.pipeline.runner import train

    run_dir = runs / f"{arm}_{seed}"
    if run_dir.exists():  # a part is redone whole: its curve and its ledger must come from one run
        shutil.rmtree(run_dir)
    cfg = load_arm_config(arm, seed, run_dir, extra)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    summary = asyncio.run(train(cfg, fresh=True, progress=False))
    wall_s = time.perf_counter() - t0
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    charges = train_charges(Path(cfg.cascade.ledger_path))
    curve = learning_curve(evals, charges, first_step_of_tasks(run_dir / "episodes.jsonl"))
    result = {
        "arm": arm,
        "seed": seed,
        "overrides": [*ARMS[arm], *extra],
        "command": ["python", "benchmarks/cascade.py", "--arm", arm, "--seed", str(seed)]
        + [f"--set={x}" for x in extra],
        "steps": summary["step"],
        "curve": curve,
        "final_heldout_truth": curve[-1]["heldout_truth"],
        "truth_gpu_h": sum(cost for _, cost in charges),
        "train_truth_calls": len(charges),
        **asyncio.run(reward_fidelity(arm, seed)),
        "wall_s": wall_s,
        "loadavg_1m": [load_before[0], os.getloadavg()[0]],
    }
    parts.mkdir(parents=True, exist_ok=True)
    path = parts / f"{arm}_{seed}.json"
    path.write_text(json.dumps(result, indent=2))
    return path


def median_curve(results: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per eval step present in every seed: the median held-out truth reward and median compute."""
    steps = sorted(set.intersection(*({p["step"] for p in r["curve"]} for r in results)))
    out = []
    for step in steps:
        points = [next(p for p in r["curve"] if p["step"] == step) for r in results]
        out.append(
            {
                "step": step,
                "heldout_truth": statistics.median(p["heldout_truth"] for p in points),
                "truth_gpu_h": statistics.median(p["truth_gpu_h"] for p in points),
            }
        )
    return out


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: final held-out truth reward (median, range), compute, ratios to the baseline; the goal per gated arm."""
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_arm.setdefault(r["arm"], []).append(r)
    rows: dict[str, dict[str, Any]] = {}
    for arm, runs in by_arm.items():
        finals = [r["final_heldout_truth"] for r in runs]
        rows[arm] = {
            "seeds": sorted(r["seed"] for r in runs),
            "final_median": statistics.median(finals),
            "final_range": [min(finals), max(finals)],
            "truth_gpu_h": statistics.median(r["truth_gpu_h"] for r in runs),
            "train_truth_calls": statistics.median(r["train_truth_calls"] for r in runs),
            "reward_truth_corr": statistics.median(r["reward_truth_corr"] for r in runs),
            "curve": median_curve(runs),
        }
    base = rows.get(BASELINE)
    for row in rows.values():
        row["compute_ratio"] = (
            row["truth_gpu_h"] / base["truth_gpu_h"] if base and base["truth_gpu_h"] else None
        )
        reached = (
            next((p for p in row["curve"] if p["heldout_truth"] >= base["final_median"]), None)
            if base
            else None
        )
        row["reach_gpu_h"] = reached["truth_gpu_h"] if reached else None
        row["reach_ratio"] = (
            reached["truth_gpu_h"] / base["truth_gpu_h"] if reached and base and base["truth_gpu_h"] else None
        )
    goal = {
        arm: {
            "reaches_baseline_within_share": rows[arm]["reach_ratio"] is not None
            and rows[arm]["reach_ratio"] <= GOAL_COMPUTE_SHARE,
            "beats_always_cheap": rows[arm]["final_median"] > rows["always-cheap"]["final_median"],
        }
        for arm in GATED_ARMS
        if base and arm in rows and "always-cheap" in rows
    }
    return {"arms": rows, "goal": goal or None, "goal_compute_share": GOAL_COMPUTE_SHARE}


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(summary: dict[str, Any]) -> str:
    head = (
        f"{'arm':<18}{'seeds':>6}{'final truth (median [range])':>32}{'truth GPU-h':>13}"
        f"{'ratio':>8}{'reach GPU-h':>13}{'reach ratio':>13}{'corr(r,e)':>11}"
    )
    lines = [head]
    for arm, row in summary["arms"].items():
        lo, hi = row["final_range"]
        final = f"{row['final_median']:.3f} [{lo:.3f}, {hi:.3f}]"
        lines.append(
            f"{arm:<18}{len(row['seeds']):>6}{final:>32}"
            f"{row['truth_gpu_h']:>13.4f}{_fmt(row['compute_ratio'], '.3f'):>8}{_fmt(row['reach_gpu_h'], '.4f'):>13}"
            f"{_fmt(row['reach_ratio'], '.3f'):>13}{_fmt(row['reward_truth_corr'], '.3f'):>11}"
        )
    if summary["goal"] is not None:
        lines.append(f"goal: {json.dumps(summary['goal'])} (share {summary['goal_compute_share']})")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    colors = {arm: f"C{i}" for i, arm in enumerate(ARMS)}
    seen: set[str] = set()
    for r in sorted(results, key=lambda r: (r["arm"], r["seed"])):
        xs = [p["truth_gpu_h"] for p in r["curve"]]
        ys = [p["heldout_truth"] for p in r["curve"]]
        label = r["arm"] if r["arm"] not in seen else None
        seen.add(r["arm"])
        ax.plot(xs, ys, marker="o", ms=3, color=colors.get(r["arm"], "k"), label=label)
    ax.set_xlabel("expensive (truth) compute spent on training, GPU-h")
    ax.set_ylabel("held-out truth reward")
    ax.set_title("synthetic/cascade-v0, one line per seed", fontsize=10)
    ax.legend()
    return save_figure(fig, path)


def merge(parts: Path, out_dir: Path) -> dict[str, Any]:
    results = [json.loads(p.read_text()) for p in sorted(parts.glob("*.json"))]
    if not results:
        raise SystemExit(f"no parts in {parts}: run --arm NAME --seed S first")
    summary = summarise(results)
    print(table(summary))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cascade.json").write_text(json.dumps(summary, indent=2))
    plot(results, out_dir / "cascade.png")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--arm", choices=sorted(ARMS), help="train this arm (one part)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    p.add_argument("--merge", action="store_true", help="table and plot from every part")
    p.add_argument("--reprobe", action="store_true", help="redo the reward-fidelity probe of every part")
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "cascade-bench", help="run directories")
    p.add_argument("--parts", type=Path, default=PARTS, help="where parts are written and merged from")
    p.add_argument("--out", type=Path, default=RESULTS, help="where --merge writes cascade.json and .png")
    args = p.parse_args(argv)
    if args.arm is None and not args.merge and not args.reprobe:
        p.error("give --arm NAME (one part), --reprobe or --merge")
    if args.reprobe:
        for path in sorted(args.parts.glob("*.json")):
            reprobe(path)
    if args.arm is not None:
        path = run_part(args.arm, args.seed, args.set, args.runs, args.parts)
        row = json.loads(path.read_text())
        print(
            f"{args.arm} seed {args.seed}: final held-out truth {row['final_heldout_truth']:.3f}, "
            f"truth {row['truth_gpu_h']:.4f} GPU-h ({row['train_truth_calls']} calls), "
            f"corr(r, e) {row['reward_truth_corr']:.3f}, {row['wall_s'] / 60:.1f} min -> {path}"
        )
    if args.merge:
        merge(args.parts, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
