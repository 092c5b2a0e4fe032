"""Sync vs pipeline on the same workload: wall-clock for the same number of trained samples.

Workload: the quickstart (configs/quickstart.yaml: tiny MoE, LocalSampler +
MegatronLearner, router replay, M2PO, 8 groups x 8 per step, XRD tier 1) with
an extra lognormal env latency per training episode (median ``--latency-p50``
seconds, p99/p50 = 20, i.e. sigma = ln 20 / 2.326; held-out episodes have
none). One format-only warm start is shared, then each mode trains
``--steps`` steps from the same weights and seed. Reported per mode:
wall-clock, trained samples, learner and sampler busy fractions, mean batch
reward of the last 3 steps, held-out accuracy at step 0 and at the end, and
the speed-up sync / pipeline.

    .venv/bin/python benchmarks/pipeline.py                 # 60 steps: ~25 min on 2 cores
    .venv/bin/python benchmarks/pipeline.py --steps 2 --latency-p50 0.05 --out /tmp/p.json  # smoke
    .venv/bin/python benchmarks/pipeline.py --steps 30 --modes pipeline --out /tmp/tail.json  # the staleness tail only
    .venv/bin/python benchmarks/pipeline.py --steps 6 --trace-cost 2 --out /tmp/traces.json  # episodes.jsonl's cost

``--trace-cost N`` runs pipeline mode 2N times instead, alternating
``pipeline.episode_traces`` off and on (each run into a fresh run directory, so
both write trained.jsonl and a final checkpoint alike), and reports the median
wall seconds per trained sample of each and their ratio (on / off).

Writes benchmarks/results/pipeline.json and pipeline.png. CPU is shared:
compare the two modes of one run (a ratio), not absolute seconds across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml
from _torch_threads import parse_with_threads  # beside this script

from labrl.envs import Env, make
from labrl.harness.backends.parts import EnvFactory, build_learner, build_sampler, make_env_factory
from labrl.harness.config import build_run_config
from labrl.harness.pipeline import Orchestrator
from labrl.harness.rollout.sft import run_sft
from labrl.harness.tokenizer import ByteTokenizer
from labrl.harness.types import SamplingParams

RESULTS = Path(__file__).parent / "results"
QUICKSTART = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
SIGMA = math.log(20.0) / 2.326  # p99 / p50 = 20 for a lognormal


class LatencyEnv(Env):
    """Delegates to an env and sleeps a lognormal time per step (deterministic per task seed)."""

    def __init__(self, inner: Env, p50: float) -> None:
        self.inner, self.p50 = inner, p50
        self.spec = inner.spec
        self._delay = 0.0

    def make_task(self, split, seed):
        return self.inner.make_task(split, seed)

    async def reset(self, task):
        rng = random.Random(f"latency:{task.split}:{task.seed}")
        self._delay = self.p50 * math.exp(SIGMA * rng.gauss(0.0, 1.0)) if task.split == "train" else 0.0
        return await self.inner.reset(task)

    async def step(self, action):
        await asyncio.sleep(self._delay)
        return await self.inner.step(action)

    async def close(self):
        await self.inner.close()


#: ``LatencyEnv`` in the env registry (``latency_env``), for runs whose envs are made elsewhere (Ray's env workers)
LATENCY_ENV_ID = "bench/lognormal-latency-v0"


class RegisteredLatencyEnv(LatencyEnv):
    """``LatencyEnv`` under ``LATENCY_ENV_ID``: its tasks carry that id (the registry's wrapper checks it)
    and reach the inner env (made unchecked) with the inner's id back."""

    def __init__(self, inner_id: str, latency_p50: float, **inner_options) -> None:
        super().__init__(make(inner_id, checked=False, **inner_options), latency_p50)
        self.inner_id = inner_id
        self.spec = self.inner.spec.model_copy(update={"id": LATENCY_ENV_ID})

    def _inner_task(self, task):
        return task.model_copy(update={"env_id": self.inner_id})

    def make_task(self, split, seed):
        return self.inner.make_task(split, seed).model_copy(update={"env_id": LATENCY_ENV_ID})

    async def reset(self, task):
        return await super().reset(self._inner_task(task))

    def gold_actions(self, task):
        return self.inner.gold_actions(self._inner_task(task))

    def random_action(self, task, rng):
        return self.inner.random_action(self._inner_task(task), rng)


def config(mode: str, args) -> dict:
    """The quickstart's workload (configs/quickstart.yaml) with only mode, length and eval changed."""
    data = yaml.safe_load(QUICKSTART.read_text())
    data["pipeline"].update(
        mode=mode,
        total_steps=args.steps,
        max_staleness=args.max_staleness,
        eval_every=args.steps,  # held-out accuracy at step 0 and at the end, the same work in both modes
        progress=False,
        checkpoint_every=0,
    )
    data["seed"] = args.seed
    data["run_dir"] = str(RESULTS / f"pipeline_run_{mode}")
    return data


async def warm_start(args) -> dict:
    """The quickstart's format-only warm start (random candidates), shared by both modes so they start equal."""
    return await warm_start_from(config("sync", args))


async def warm_start_from(data: dict) -> dict:
    """The warm start (``sft`` section) of the run config ``data``: the learner's weights after it."""
    cfg = build_run_config(data)
    torch.manual_seed(cfg.seed)
    learner = build_learner(cfg)
    await run_sft(learner.model, make_env_factory(cfg), ByteTokenizer(), cfg.sft, seed=cfg.seed)
    return {k: v.clone() for k, v in learner.model.state_dict().items() if isinstance(v, torch.Tensor)}


async def train(
    data: dict,
    latency_p50: float,
    init_state: dict,
    run_dir: str | None = None,
    make_env: EnvFactory | None = None,
) -> tuple[Orchestrator, list[dict], float]:
    """Train the run config ``data`` from ``init_state`` on the lognormal-latency env (median
    ``latency_p50`` s), or on ``make_env``'s envs when given; the orchestrator, its step records and the
    wall seconds of ``run``. ``run_dir`` (a directory for metrics.jsonl, episodes.jsonl, ...) or none,
    as ``Orchestrator`` takes it."""
    cfg = build_run_config(data)
    torch.manual_seed(cfg.seed)
    tokenizer = ByteTokenizer()
    learner = build_learner(cfg)
    learner.model.load_state_dict(init_state, strict=False)  # _extra_state entries are not tensors
    sampler = await build_sampler(cfg, learner, tokenizer)
    records: list[dict] = []
    orch = Orchestrator(
        cfg.pipeline,
        make_env=make_env or (lambda: LatencyEnv(make(cfg.env.id, **cfg.env.options), latency_p50)),
        sampler=sampler, learner=learner, tokenizer=tokenizer,
        sampling=SamplingParams(max_new_tokens=cfg.sampler.max_new_tokens, temperature=1.0),
        seed=cfg.seed, return_routed_experts=True, on_step=records.append, run_dir=run_dir,
    )  # fmt: skip
    t0 = time.perf_counter()
    await orch.run()
    return orch, records, time.perf_counter() - t0


async def run_mode(mode: str, args, init_state: dict, *, traces: bool | None = None) -> dict:
    """One mode's run; ``traces`` on or off: into a fresh run directory, with ``episode_traces`` so set."""
    data = config(mode, args)
    run_dir = None
    if traces is not None:
        data["pipeline"]["episode_traces"] = traces
        run_dir = tempfile.mkdtemp(prefix="labrl-trace-cost-")
    orch, records, wall = await train(data, args.latency_p50, init_state, run_dir)
    last = records[-3:]
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)
    out = {
        "mode": mode,
        "traces": traces,
        "wall_s": wall,
        "trained_samples": sum(r["samples/trained"] for r in records),
        "busy_learner": records[-1]["busy/learner"],
        "busy_sampler": records[-1]["busy/sampler"],
        "final_reward": sum(r["reward/mean"] for r in last) / len(last),
        "eval_start": orch.eval_history[0]["accuracy"],
        "eval_final": orch.eval_history[-1]["accuracy"],
        "staleness_mean": sum(r["staleness/mean"] for r in records) / len(records),
        "staleness_max": max(r["staleness/max"] for r in records),
        # the tail the bound does not hold (a target, docs/training.md "Staleness"): trained, counted
        "over_bound_episodes": sum(r["staleness/over_max_episodes"] for r in records),
        "over_bound_frac": sum(r["staleness/over_max_episodes"] for r in records)
        / max(1, sum(r["samples/trained"] for r in records)),
        "env_latency_p50": sorted(r["env_latency/p50"] for r in records)[len(records) // 2],
        "env_latency_p99": max(r["env_latency/p99"] for r in records),
        "curve": [(r["time_s"], r["reward/mean"]) for r in records],
    }
    print(
        f"{mode:9s} wall {wall:7.1f} s  samples {out['trained_samples']}  busy learner {out['busy_learner']:.2f} "
        f"sampler {out['busy_sampler']:.2f}  reward(last 3) {out['final_reward']:.3f}  "
        f"held-out {out['eval_start']:.3f} -> {out['eval_final']:.3f}  "
        f"staleness mean {out['staleness_mean']:.2f} max {out['staleness_max']} "
        f"over the bound {out['over_bound_frac']:.1%}",
        flush=True,
    )
    return out


async def trace_cost(args, init_state: dict) -> None:
    """Median wall seconds per trained sample with ``episode_traces`` off and on (module docstring)."""
    runs = [
        await run_mode("pipeline", args, init_state, traces=on)
        for _ in range(args.trace_cost)
        for on in (False, True)
    ]
    per_sample = {
        on: statistics.median(r["wall_s"] / r["trained_samples"] for r in runs if r["traces"] is on)
        for on in (False, True)
    }
    ratio = per_sample[True] / per_sample[False]
    print(
        f"\nwall per trained sample: traces off {per_sample[False] * 1e3:.1f} ms, on {per_sample[True] * 1e3:.1f} ms "
        f"(median of {args.trace_cost} each); on / off = {ratio:.3f}"
    )
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "per_sample_s": {"off": per_sample[False], "on": per_sample[True]},
                    "ratio": ratio, "runs": [{k: v for k, v in r.items() if k != "curve"} for r in runs]}, indent=2)
    )  # fmt: skip


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--max-staleness", type=int, default=4)
    ap.add_argument("--latency-p50", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "pipeline.json"))
    ap.add_argument(
        "--trace-cost",
        type=int,
        default=0,
        metavar="N",
        help="instead of the modes: N pipeline runs with episode traces off and N on, alternating",
    )
    ap.add_argument(
        "--modes",
        default="sync,pipeline",
        help="comma-separated, of sync and pipeline; the speed-up needs both",
    )
    args = parse_with_threads(ap, default=1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    init_state = await warm_start(args)
    if args.trace_cost > 0:
        await trace_cost(args, init_state)
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"sync", "pipeline"}:
        ap.error(f"--modes takes sync and/or pipeline (got {args.modes!r})")
    rows = [await run_mode(mode, args, init_state) for mode in modes]
    by_mode = {r["mode"]: r for r in rows}
    speedup = by_mode["sync"]["wall_s"] / by_mode["pipeline"]["wall_s"] if len(by_mode) == 2 else None
    print(
        "\n| mode | wall (s) | samples | learner busy | sampler busy | reward (last 3 steps) | held-out start -> end "
        "| staleness mean / max | over the bound |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['wall_s']:.1f} | {r['trained_samples']} | {r['busy_learner']:.2f} | "
              f"{r['busy_sampler']:.2f} | {r['final_reward']:.3f} | {r['eval_start']:.3f} -> {r['eval_final']:.3f} | "
              f"{r['staleness_mean']:.2f} / {r['staleness_max']} | {r['over_bound_episodes']} ({r['over_bound_frac']:.1%}) |")  # fmt: skip
    if speedup is not None:
        print(
            f"\npipeline speed-up over sync: {speedup:.2f}x (env latency p50 {args.latency_p50} s, p99/p50 = 20)"
        )
    Path(args.out).write_text(json.dumps({"args": vars(args), "speedup": speedup, "modes": rows}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        xs, ys = zip(*r["curve"], strict=True)
        ax.plot(xs, ys, "o-", label=f"{r['mode']} ({r['wall_s']:.0f} s)")
    ax.set_xlabel("wall-clock (s)")
    ax.set_ylabel("batch reward")
    ax.set_title(
        f"same {rows[0]['trained_samples']} samples"
        + (f": pipeline {speedup:.1f}x faster" if speedup is not None else "")
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(args.out).with_suffix(".png"), dpi=100)


if __name__ == "__main__":
    asyncio.run(main())
