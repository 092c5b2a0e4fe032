"""Sync vs pipeline on the same workload: wall-clock for the same number of trained samples.

Workload: the tiny MoE (LocalSampler + MegatronLearner, router replay, M2PO)
on ``xrd/phase-id-v0`` tier 1, with an extra lognormal env latency per task
(median ``--latency-p50`` seconds, p99/p50 = 20, i.e. sigma = ln 20 / 2.326).
Both modes start from the same seed and train ``--steps`` steps of
``--batch-groups`` x ``--group-size`` samples. Reported per mode: wall-clock,
learner and sampler busy fractions, mean batch reward of the last steps, and
the ratio sync / pipeline.

    .venv/bin/python benchmarks/pipeline.py --steps 10      # ~10 min on 2 cores

Writes benchmarks/results/pipeline.json and pipeline.png. CPU is shared:
compare the two modes of one run (a ratio), not absolute seconds across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from pathlib import Path

import torch

from labrl.envs import Env, make
from labrl.harness.config import SFTSection, build_run_config
from labrl.harness.pipeline import Orchestrator
from labrl.harness.pipeline.runner import build_learner, build_sampler
from labrl.harness.sft import run_sft
from labrl.harness.tokenizer import ByteTokenizer
from labrl.harness.types import SamplingParams

RESULTS = Path(__file__).parent / "results"
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


def config(mode: str, args) -> dict:
    return {
        "env": {"id": "xrd/phase-id-v0", "options": {"tier": 1}},
        "model": {"preset": "tiny-moe", "overrides": {"max_sequence_length": 256}},
        "sampler": {"max_new_tokens": 2, "max_batch_size": 64},
        "learner": {"lr": 1e-3, "micro_batch_size": 32},
        "objective": {"loss": "cispo", "corrections": ["m2po"]},
        "pipeline": {
            "mode": mode,
            "batch_groups": args.batch_groups,
            "group_size": args.group_size,
            "max_staleness": args.max_staleness,
            "max_concurrent_episodes": 512,
            "total_steps": args.steps,
            "eval_every": 0,
            "progress": False,
        },
        "seed": args.seed,
        "run_dir": str(RESULTS / f"pipeline_run_{mode}"),
    }


async def warm_start(args) -> dict:
    """One format-only warm start (random letters) shared by both modes, so they start equal."""
    cfg = build_run_config(config("sync", args))
    torch.manual_seed(cfg.seed)
    learner = build_learner(cfg)
    env_cfg = SFTSection(enabled=True, steps=args.sft_steps, batch_size=32, lr=2e-3, num_prompts=128)
    await run_sft(
        learner.model, lambda: make(cfg.env.id, **cfg.env.options), ByteTokenizer(), env_cfg, seed=cfg.seed
    )
    return {k: v.clone() for k, v in learner.model.state_dict().items() if isinstance(v, torch.Tensor)}


async def run_mode(mode: str, args, init_state: dict) -> dict:
    cfg = build_run_config(config(mode, args))
    torch.manual_seed(cfg.seed)
    tokenizer = ByteTokenizer()
    learner = build_learner(cfg)
    learner.model.load_state_dict(init_state, strict=False)  # _extra_state entries are not tensors
    sampler = await build_sampler(cfg, learner, tokenizer)
    records: list[dict] = []
    orch = Orchestrator(
        cfg.pipeline,
        make_env=lambda: LatencyEnv(make(cfg.env.id, **cfg.env.options), args.latency_p50),
        sampler=sampler, learner=learner, tokenizer=tokenizer,
        sampling=SamplingParams(max_new_tokens=cfg.sampler.max_new_tokens, temperature=1.0),
        seed=cfg.seed, return_routed_experts=True, on_step=records.append,
    )  # fmt: skip
    t0 = time.perf_counter()
    await orch.run()
    wall = time.perf_counter() - t0
    last = records[-3:]
    out = {
        "mode": mode,
        "wall_s": wall,
        "trained_samples": sum(r["samples/trained"] for r in records),
        "busy_learner": records[-1]["busy/learner"],
        "busy_sampler": records[-1]["busy/sampler"],
        "final_reward": sum(r["reward/mean"] for r in last) / len(last),
        "staleness_mean": sum(r["staleness/mean"] for r in records) / len(records),
        "staleness_max": max(r["staleness/max"] for r in records),
        "env_latency_p50": sorted(r["env_latency/p50"] for r in records)[len(records) // 2],
        "env_latency_p99": max(r["env_latency/p99"] for r in records),
        "curve": [(r["time_s"], r["reward/mean"]) for r in records],
    }
    print(
        f"{mode:9s} wall {wall:7.1f} s  samples {out['trained_samples']}  busy learner {out['busy_learner']:.2f} "
        f"sampler {out['busy_sampler']:.2f}  reward(last 3) {out['final_reward']:.3f}  "
        f"staleness mean {out['staleness_mean']:.2f} max {out['staleness_max']}",
        flush=True,
    )
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-staleness", type=int, default=8)
    ap.add_argument("--latency-p50", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sft-steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    RESULTS.mkdir(parents=True, exist_ok=True)
    init_state = await warm_start(args)
    rows = [await run_mode("sync", args, init_state), await run_mode("pipeline", args, init_state)]
    speedup = rows[0]["wall_s"] / rows[1]["wall_s"]
    print("\n| mode | wall (s) | samples | learner busy | sampler busy | reward (last 3 steps) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['wall_s']:.1f} | {r['trained_samples']} | {r['busy_learner']:.2f} | "
              f"{r['busy_sampler']:.2f} | {r['final_reward']:.3f} |")  # fmt: skip
    print(
        f"\npipeline speed-up over sync: {speedup:.2f}x (env latency p50 {args.latency_p50} s, p99/p50 = 20)"
    )
    (RESULTS / "pipeline.json").write_text(
        json.dumps({"args": vars(args), "speedup": speedup, "modes": rows}, indent=2)
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        xs, ys = zip(*r["curve"], strict=True)
        ax.plot(xs, ys, "o-", label=f"{r['mode']} ({r['wall_s']:.0f} s)")
    ax.set_xlabel("wall-clock (s)")
    ax.set_ylabel("batch reward")
    ax.set_title(f"same {rows[0]['trained_samples']} samples: pipeline {speedup:.1f}x faster")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "pipeline.png", dpi=100)


if __name__ == "__main__":
    asyncio.run(main())
