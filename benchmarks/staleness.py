"""Forced staleness: train on samples exactly k learner updates old, with and without corrections.

A plain synchronous reference loop (no orchestrator, so nothing else varies):

    for step v = 0..N-1:
        sampler loads the learner's weights of version max(0, v - k)   # forced staleness k
        generate B groups of G episodes, score them
        learner.train_step(batch)                                       # objective with the correction

k in {0, 8, 64, 256} x corrections {none, tis, token_mask, m2po} (loss CISPO
for all, so "none" is CISPO's policy-ratio clip only, which never sees the
behaviour mismatch). After N updates: held-out accuracy (greedy, latest
weights) and whether training collapsed (final accuracy below chance + 0.05,
or a non-finite loss).

Task, the smallest on which on-policy training learns reliably here: the
``copy`` env below (the prompt shows one of 8 letters; reward 1 for replying
with it; chance 1/8), a 2-layer MoE (hidden 32, 4 experts, top-2) from
scratch, 100 format-only warm-start steps (random letters), batch 8 groups x 4,
AdamW lr 3e-4. Found by trial: at lr 3e-3 on-policy training collapses to
near-uniform output over all 264 tokens within 50 updates, at 1e-3 it
oscillates and collapses by update 125, at 3e-4 and 5e-4 it reaches 0.94-1.0
by update 800-1100 (0.06-0.08 s per update). k must be small against N, so
the default is N = 4096 updates per run: the full grid took 78 min of one core
(4.5-5.5 min per run) and runs in the background, not in the tests.

    .venv/bin/python benchmarks/staleness.py --updates 4096          # ~80 min
    .venv/bin/python benchmarks/staleness.py --updates 30 --ks 0 8   # smoke test
    .venv/bin/python benchmarks/staleness.py --render a.json b.json  # merge runs split over processes

Writes benchmarks/results/staleness.json (+ .png), rewriting it after every run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
import time
from collections import deque
from pathlib import Path

import torch

from labrl.envs import Action, Env, EnvSpec, Message, Observation, StepResult, Task
from labrl.harness.batching import collate
from labrl.harness.config import SFTSection
from labrl.harness.learners import LearnerConfig, MegatronLearner, OptimizerConfig
from labrl.harness.models.config import MoEModelConfig
from labrl.harness.objectives import ObjectiveConfig
from labrl.harness.rollout import rollout, rollout_group
from labrl.harness.samplers.local import LocalSampler, LocalSamplerConfig
from labrl.harness.sft import run_sft
from labrl.harness.tokenizer import ByteTokenizer
from labrl.harness.types import SamplingParams

RESULTS = Path(__file__).parent / "results"
LETTERS = string.ascii_uppercase[:8]
CORRECTIONS = {"none": [], "tis": ["tis"], "token_mask": ["token_mask"], "m2po": ["m2po"]}
MODEL = MoEModelConfig(
    name="staleness-moe", num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
    num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, vocab_size=264, max_sequence_length=64,
)  # fmt: skip


class CopyEnv(Env):
    """Reply with the letter shown. Reward 1 if exact, else 0."""

    def __init__(self) -> None:
        self.spec = EnvSpec(id="bench/copy-v0", has_gold_answer=True)
        self.task: Task | None = None

    def make_task(self, split, seed):
        letter = random.Random(f"{split}:{seed}").choice(LETTERS)
        return Task(
            env_id=self.spec.id, split=split, seed=seed, task_id=f"copy-{split}-{seed}", answer=letter
        )

    async def reset(self, task):
        self.task = task
        return Observation(messages=(Message(role="user", content=task.answer),))

    async def step(self, action):
        assert self.task is not None
        return StepResult(reward=float(action.text.strip() == self.task.answer), done=True)

    def random_action(self, task, rng):
        return Action(text=rng.choice(LETTERS))


async def accuracy(sampler, tok, n: int) -> float:
    sampling = SamplingParams(max_new_tokens=2, temperature=0.0)
    env = CopyEnv()
    trajs = await asyncio.gather(
        *(rollout(CopyEnv(), env.make_task("test", i), sampler, tok, sampling) for i in range(n))
    )
    return sum(t.reward == 1.0 for t in trajs) / n


async def one_run(k: int, correction: str, args) -> dict:
    torch.manual_seed(args.seed)
    tok = ByteTokenizer()
    learner = MegatronLearner(
        LearnerConfig(
            model=MODEL,
            objective=ObjectiveConfig(loss="cispo", corrections=CORRECTIONS[correction]),
            optimizer=OptimizerConfig(lr=args.lr),
            micro_batch_size=64,
            seed=args.seed,
        )
    )
    await run_sft(
        learner.model,
        CopyEnv,
        tok,
        SFTSection(enabled=True, steps=args.sft_steps, batch_size=16, lr=3e-3, num_prompts=64),
        seed=args.seed,
    )
    sampler = LocalSampler(
        MODEL,
        LocalSamplerConfig(seed=args.seed, pad_token_id=tok.pad_token_id),
        weights=learner.export_weights(),
    )
    snapshots: deque = deque([(0, learner.export_weights())], maxlen=k + 1)
    sampling = SamplingParams(max_new_tokens=2, temperature=1.0)
    curve, collapsed, t0 = [], False, time.perf_counter()
    task_env = CopyEnv()
    for v in range(args.updates):
        version, weights = snapshots[0]  # the oldest kept snapshot = version max(0, v - k)
        if sampler.version != version:
            await sampler.update_weights(weights, version)
        groups = await asyncio.gather(
            *(
                rollout_group(
                    CopyEnv,
                    task_env.make_task("train", v * args.groups + g),
                    sampler,
                    tok,
                    # members get seed + 0..G-1; another --seed draws other samples, seed 0 keeps the recorded runs
                    sampling.model_copy(update={"seed": args.seed * 1_000_003 + (v * args.groups + g) * 4}),
                    args.group_size,
                    return_routed_experts=True,
                )
                for g in range(args.groups)
            )
        )
        trajs = [t for grp in groups for t in grp]
        try:
            m = await asyncio.to_thread(learner.train_step, collate(trajs, tok.pad_token_id))
        except Exception as exc:  # a non-finite loss is a collapse, recorded as data
            collapsed = True
            curve.append({"update": v, "error": str(exc)})
            break
        snapshots.append((learner.version, learner.export_weights()))
        if v % max(1, args.updates // 16) == 0 or v == args.updates - 1:
            curve.append({"update": v + 1, "reward": sum(t.reward for t in trajs) / len(trajs),
                          "kept_frac": m.get("corrections/kept_frac"), "staleness": m.get("staleness/mean")})  # fmt: skip
    await sampler.update_weights(learner.export_weights(), learner.version)
    acc = await accuracy(sampler, tok, args.eval_size)
    collapsed = collapsed or acc < 1 / len(LETTERS) + 0.05
    row = {"k": k, "correction": correction, "updates": args.updates, "accuracy": acc, "collapsed": collapsed,
           "wall_s": time.perf_counter() - t0, "curve": curve}  # fmt: skip
    print(
        f"k={k:4d} {correction:10s} accuracy {acc:.3f} collapsed {collapsed} ({row['wall_s']:.0f} s)",
        flush=True,
    )
    return row


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates", type=int, default=4096)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 8, 64, 256])
    ap.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--sft-steps", type=int, default=100)
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "staleness.json"))
    ap.add_argument("--render", nargs="+", metavar="JSON", help="merge finished runs from these result files "
                    "into --out and print the table, without training")  # fmt: skip
    args = ap.parse_args()
    if args.render:
        rows = [r for f in args.render for r in json.loads(Path(f).read_text())["runs"]]
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2))
        render(rows, Path(args.out))
        return
    torch.set_num_threads(1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    for k in args.ks:
        for c in args.corrections:
            rows.append(await one_run(k, c, args))
            Path(args.out).write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2))
    render(rows, Path(args.out))


def render(rows: list[dict], out: Path) -> None:
    """Print the k x correction table (accuracy, and its ratio to on-policy) and plot it next to ``out``."""
    ks = sorted({r["k"] for r in rows})
    corrections = [c for c in CORRECTIONS if any(r["correction"] == c for r in rows)]
    cell = {(r["k"], r["correction"]): r for r in rows}
    on_policy = [r["accuracy"] for r in rows if r["k"] == 0]
    base = sum(on_policy) / len(on_policy) if on_policy else None
    print("\n| k | " + " | ".join(corrections) + " |")
    print("|---|" + "---|" * len(corrections))
    for k in ks:
        cells = []
        for c in corrections:
            r = cell.get((k, c))
            if r is None:
                cells.append("-")
                continue
            kept = [p["kept_frac"] for p in r["curve"] if p.get("kept_frac") is not None]
            text = f"{r['accuracy']:.3f}"
            if base:
                text += f" ({r['accuracy'] / base:.0%})"
            if c in ("token_mask", "m2po") and kept:
                text += f", kept {sum(kept) / len(kept):.2f}"
            learned = next((p["update"] for p in r["curve"] if p.get("reward", 0.0) >= 0.9), None)
            text += f", >=0.9 @ {learned}" if learned is not None else ", never >=0.9"
            cells.append(text + (" collapsed" if r["collapsed"] else ""))
        print(f"| {k} | " + " | ".join(cells) + " |")
    if base is not None:
        print(f"on-policy (k=0) accuracy, mean over corrections: {base:.3f}; (x%) = ratio to it")
    print("kept = mean fraction of tokens kept by the mask at the logged updates; >=0.9 @ = first logged")
    print("update (every N/16) whose batch reward reached 0.9")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_curve) = plt.subplots(1, 2, figsize=(11, 4))
    for c in corrections:
        pts = sorted((r["k"], r["accuracy"]) for r in rows if r["correction"] == c)
        ax.plot([max(p[0], 0.5) for p in pts], [p[1] for p in pts], "o-", label=c)
    ax.set_xscale("log")
    ax.axhline(1 / len(LETTERS), color="grey", ls=":", label="chance")
    ax.set_xlabel("forced staleness k (0 plotted at 0.5)")
    ax.set_ylabel("held-out accuracy after training")
    ax.legend()
    for r in rows:
        if r["k"] == max(ks) or (r["k"] == 0 and r["correction"] == "none"):
            pts = [(p["update"], p["reward"]) for p in r["curve"] if "reward" in p]
            ax_curve.plot(*zip(*pts, strict=True), label=f"k={r['k']} {r['correction']}")
    ax_curve.set_xlabel("update")
    ax_curve.set_ylabel("batch reward")
    ax_curve.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)


if __name__ == "__main__":
    asyncio.run(main())
