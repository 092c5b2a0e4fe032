"""Forced staleness: train on samples exactly k learner updates old, with and without corrections.

A plain synchronous reference loop (no orchestrator, so nothing else varies):

    for step v = 0..N-1:
        sampler loads the learner's weights of version max(0, v - k)   # forced staleness k
        generate B groups of G episodes, score them
        learner.train_step(batch)                                       # objective with the correction

Cells (``--corrections``), each naming its loss and correction exactly:

    none           CISPO (eps 1.0 / 0.28), no behaviour correction: CISPO's ratio clip only, which
                   never sees the behaviour mismatch (one step per batch: pi_theta = pi_prox there)
    tis            CISPO + token TIS, weight min(pi_prox / mu, 2)
    token_mask     CISPO + token mask [0.5, 5] (mask only)
    icepop         CISPO + IcePop [0.5, 5]: mask outside the band, weight pi_prox / mu inside
    m2po           CISPO + M2PO (tau 0.04)
    opsm           CISPO + OPSM (delta 1e-4): drop A < 0 sequences with mean(logp_mu - logp) > delta
    decoupled_ppo  PPO clip (0.2 / 0.28) against the proximal policy, learner.epochs 2 (two optimizer
                   steps per batch, one version), + M2PO (tau 0.04) on behaviour-to-proximal

After N updates: held-out accuracy (greedy, latest weights) and whether training
collapsed (final accuracy below chance + 0.05, or a non-finite loss). Held-out
accuracy is also measured every ``--eval-every`` updates for the accuracy-vs-step plot.

Tasks (``--task``), with what on-policy training (k = 0, ``none``) did on them
(seed 0, held-out accuracy over 128 greedy episodes; benchmarks/README.md):

- ``copy`` (the recorded default, ``--letters 8``): the prompt shows one of 8
  letters; reward 1 for replying with it; chance 1/8. Too easy to separate the
  corrections: every corrected cell ends at 1.000 at k = 256.
- ``copy --letters 26``: the same over 26 letters, chance 1/26: on-policy needs
  about 2,000 updates (seed 0: 0.27 at update 1024, 0.73 at 2048, 0.84 at 2560
  and 3072; seed 1: 0.64 at 3072, still rising); the task of the issue-18 grid.
  With ``--retry-all-wrong 4`` (the quickstart's retry) on-policy reaches 1.000 on both
  seeds by update 2,048; a cosine ``--schedule`` ends far lower (benchmarks/README.md).
- ``shift``: reply with the letter after the one shown (wrapping); chance
  1/letters. Not harder: 1.000 by update 1024 with 8 letters.
- ``add``: the prompt shows ``a+b`` with operands in 0..``--add-digits``-1
  (default 5); reward 1 for replying with a + b in decimal; chance
  1 / (2 * digits - 1). Too hard for this model so far: greedy accuracy stayed
  at the modal answer's share for 2048 updates (digits 5 at lr 3e-4 and 1e-3,
  digits 3 at lr 5e-4, and digits 3 through 2560 updates of a longer run).

Model: a 2-layer MoE (hidden 32, 4 experts, top-2) from scratch, 100 format-only
warm-start steps (random answers), batch 8 groups x 4, AdamW lr 3e-4 (found by
trial on copy: at lr 3e-3 on-policy training collapses to near-uniform output
within 50 updates, at 1e-3 it oscillates and collapses by update 125, at 3e-4
and 5e-4 it reaches 0.94-1.0 by update 800-1100, 0.06-0.08 s per update on a
free core). k must be small against N, so the default is N = 4096 updates per
run: the copy grid took 78 min of one core (4.5-5.5 min per run).

One process per cell, merged afterwards (the full grid takes hours)::

    .venv/bin/python benchmarks/staleness.py --updates 4096                       # copy grid, ~80 min
    .venv/bin/python benchmarks/staleness.py --task copy --letters 26 --updates 3072 --ks 256 \
        --corrections tis --out benchmarks/results/staleness_c26/k256_tis.json     # one cell
    .venv/bin/python benchmarks/staleness.py --updates 30 --ks 0 8                # smoke test
    .venv/bin/python benchmarks/staleness.py --render a.json b.json --out merged.json   # merge + plot

Writes ``--out`` (default benchmarks/results/staleness.json, + .png), rewriting it after every run.
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
from _results import RESULTS, pyplot, save_figure  # beside this script

from labrl.envs import Action, Env, EnvSpec, Message, Observation, StepResult, Task
from labrl.harness.learners import LearnerConfig, MegatronLearner, OptimizerConfig
from labrl.harness.models.config import MoEModelConfig
from labrl.harness.objectives import M2PO, OPSM, TIS, IcePop, ObjectiveConfig, TokenMask
from labrl.harness.rollout.batching import collate
from labrl.harness.rollout.play import rollout, rollout_group
from labrl.harness.rollout.sft import SFTSection, run_sft
from labrl.harness.samplers.local import LocalSampler, LocalSamplerConfig
from labrl.harness.tokenizer import ByteTokenizer
from labrl.harness.types import SamplingParams

LETTERS = string.ascii_uppercase[:8]
# cell -> (objective, learner overrides); see the module docstring for the exact definitions.
CORRECTIONS: dict[str, tuple[ObjectiveConfig, dict]] = {
    "none": (ObjectiveConfig(loss="cispo", corrections=[]), {}),
    "tis": (ObjectiveConfig(loss="cispo", corrections=[TIS(c=2.0)]), {}),
    "token_mask": (ObjectiveConfig(loss="cispo", corrections=[TokenMask(low=0.5, high=5.0)]), {}),
    "icepop": (ObjectiveConfig(loss="cispo", corrections=[IcePop(low=0.5, high=5.0)]), {}),
    "m2po": (ObjectiveConfig(loss="cispo", corrections=[M2PO(tau=0.04)]), {}),
    "opsm": (ObjectiveConfig(loss="cispo", corrections=[OPSM(delta=1e-4)]), {}),
    "decoupled_ppo": (ObjectiveConfig(loss="ppo", corrections=[M2PO(tau=0.04)]), {"epochs": 2}),
}
# Fractions logged along the curve (absent keys are skipped).
CURVE_KEYS = (
    "corrections/kept_frac", "corrections/masked_frac", "opsm/masked_frac", "policy/clip_low_frac",
    "policy/clip_high_frac", "policy/dual_clip_frac", "mismatch/abs_log_ratio_mean",
    "policy/abs_log_ratio_mean", "staleness/mean",
)  # fmt: skip
MODEL = MoEModelConfig(
    name="staleness-moe", num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
    num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, vocab_size=264, max_sequence_length=64,
)  # fmt: skip


class CopyEnv(Env):
    """Reply with the letter shown. Reward 1 if exact, else 0."""

    letters = LETTERS  # set from --letters

    @classmethod
    def chance(cls) -> float:
        return 1 / len(cls.letters)

    def __init__(self) -> None:
        self.spec = EnvSpec(id="bench/copy-v0", has_gold_answer=True)
        self.task: Task | None = None

    def make_task(self, split, seed):
        letter = random.Random(f"{split}:{seed}").choice(self.letters)
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
        return Action(text=rng.choice(self.letters))


class ShiftEnv(CopyEnv):
    """The prompt shows one of 8 letters; reply with the next one (H wraps to A). Chance 1/8.

    The same one-position lookup as ``copy``, with a mapping other than the identity.
    """

    def __init__(self) -> None:
        self.spec = EnvSpec(id="bench/shift-v0", has_gold_answer=True)
        self.task: Task | None = None

    def make_task(self, split, seed):
        i = random.Random(f"shift:{split}:{seed}").randrange(len(self.letters))
        return Task(
            env_id=self.spec.id,
            split=split,
            seed=seed,
            task_id=f"shift-{split}-{seed}",
            prompt={"text": self.letters[i]},
            answer=self.letters[(i + 1) % len(self.letters)],
        )

    async def reset(self, task):
        self.task = task
        return Observation(messages=(Message(role="user", content=task.prompt["text"]),))


class AddEnv(Env):
    """The prompt is ``a+b`` (operands 0..digits-1); reply with a + b in decimal. Reward 1 if exact, else 0."""

    digits = 5  # set from --add-digits; 5: operands 0..4, sums 0..8

    @classmethod
    def chance(cls) -> float:
        return 1 / (2 * cls.digits - 1)

    def __init__(self) -> None:
        self.spec = EnvSpec(id="bench/add-v0", has_gold_answer=True)
        self.task: Task | None = None

    def make_task(self, split, seed):
        rng = random.Random(f"add:{split}:{seed}")
        a, b = rng.randrange(self.digits), rng.randrange(self.digits)
        return Task(
            env_id=self.spec.id,
            split=split,
            seed=seed,
            task_id=f"add-{split}-{seed}",
            answer=str(a + b),
            prompt={"text": f"{a}+{b}"},
        )

    async def reset(self, task):
        self.task = task
        return Observation(messages=(Message(role="user", content=task.prompt["text"]),))

    async def step(self, action):
        assert self.task is not None
        return StepResult(reward=float(action.text.strip() == self.task.answer), done=True)

    def random_action(self, task, rng):
        return Action(text=str(rng.randrange(2 * self.digits - 1)))


TASKS = {"copy": CopyEnv, "shift": ShiftEnv, "add": AddEnv}


async def accuracy(env_cls, sampler, tok, n: int) -> float:
    sampling = SamplingParams(max_new_tokens=2, temperature=0.0)
    env = env_cls()
    trajs = await asyncio.gather(
        *(rollout(env_cls(), env.make_task("test", i), sampler, tok, sampling) for i in range(n))
    )
    return sum(t.reward == 1.0 for t in trajs) / n


async def play_group(env_cls, task_env, index: int, sampler, tok, sampling, args) -> list:
    """Group ``index`` of the batch; with ``--retry-all-wrong N`` a group whose every member was
    wrong is played again on the same task (fresh samples), up to N more times, and the last try
    is trained. The pipeline's ``retry_all_wrong`` (the quickstart's fix for tasks the policy has
    drifted away from, whose all-wrong groups carry no GRPO signal) in this synchronous loop."""
    task = task_env.make_task("train", index)
    for attempt in range(args.retry_all_wrong + 1):
        # members get seed + 0..G-1; another --seed draws other samples, seed 0 (no retry) keeps the recorded runs
        seed = args.seed * 1_000_003 + index * 4 + attempt * 7_919_993
        group = await rollout_group(
            env_cls, task, sampler, tok, sampling.model_copy(update={"seed": seed}), args.group_size,
            return_routed_experts=True,
        )  # fmt: skip
        if any(t.reward == 1.0 for t in group):
            break
    return group


async def one_run(k: int, correction: str, args, on_eval=None) -> dict:
    """Train one cell; ``on_eval(partial_row)`` is called after every intermediate held-out eval."""
    torch.manual_seed(args.seed)
    tok = ByteTokenizer()
    env_cls = TASKS[args.task]
    objective, learner_overrides = CORRECTIONS[correction]
    learner = MegatronLearner(
        LearnerConfig(
            model=MODEL,
            objective=objective,
            optimizer=optimizer_config(args),
            micro_batch_size=64,
            seed=args.seed,
            **learner_overrides,
        )
    )
    await run_sft(
        learner.model,
        env_cls,
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
    curve, evals, collapsed, t0 = [], [], False, time.perf_counter()
    task_env = env_cls()
    log_every = max(1, args.updates // 32)
    eval_every = args.eval_every or max(1, args.updates // 8)
    for v in range(args.updates):
        version, weights = snapshots[0]  # the oldest kept snapshot = version max(0, v - k)
        if sampler.version != version:
            await sampler.update_weights(weights, version)
        groups = await asyncio.gather(
            *(
                play_group(env_cls, task_env, v * args.groups + g, sampler, tok, sampling, args)
                for g in range(args.groups)
            )
        )
        trajs = [t for grp in groups for t in grp]
        try:
            m = await asyncio.to_thread(learner.train_step, collate(trajs, tok.pad_token_id))
        except Exception as exc:  # stopping on repeated non-finite steps is a collapse, recorded as data
            collapsed = True
            curve.append({"update": v, "error": str(exc)})
            break
        snapshots.append((learner.version, learner.export_weights()))
        if v % log_every == 0 or v == args.updates - 1:
            point = {"update": v + 1, "reward": sum(t.reward for t in trajs) / len(trajs)}
            point |= {key: m[key] for key in CURVE_KEYS if key in m}
            point["kept_frac"] = m.get("corrections/kept_frac")  # the name older result files use
            curve.append(point)
        if (v + 1) % eval_every == 0 and v + 1 < args.updates:
            # The sampler goes back to its stale snapshot at the next update.
            await sampler.update_weights(learner.export_weights(), learner.version)
            evals.append({"update": v + 1, "accuracy": await accuracy(env_cls, sampler, tok, args.eval_size)})
            print(f"  {correction} k={k} update {v + 1}: held-out {evals[-1]['accuracy']:.3f}", flush=True)
            if on_eval is not None:
                on_eval(_row(args, env_cls, k, correction, objective, learner_overrides, curve, evals, t0)
                        | {"partial": True, "last_eval_update": v + 1, "accuracy": evals[-1]["accuracy"],
                           "collapsed": collapsed})  # fmt: skip
    await sampler.update_weights(learner.export_weights(), learner.version)
    acc = await accuracy(env_cls, sampler, tok, args.eval_size)
    evals.append({"update": learner.step, "accuracy": acc})
    collapsed = collapsed or acc < env_cls.chance() + 0.05
    row = _row(args, env_cls, k, correction, objective, learner_overrides, curve, evals, t0)
    row |= {"accuracy": acc, "collapsed": collapsed}
    print(
        f"{args.task} k={k:4d} {correction:13s} accuracy {acc:.3f} collapsed {collapsed} "
        f"({row['wall_s']:.0f} s)",
        flush=True,
    )
    return row


def optimizer_config(args) -> OptimizerConfig:
    """AdamW at ``--lr``: constant (the recorded grids), or the quickstart's fix for late-run undoing,
    ``--schedule cosine``: linear warm-up over ``--warmup`` updates, then cosine to ``--lr`` x 0.1 at
    the last update (``OptimizerConfig``'s formula)."""
    if args.schedule == "constant":
        return OptimizerConfig(lr=args.lr)
    return OptimizerConfig(lr=args.lr, schedule="cosine", warmup_steps=args.warmup, total_steps=args.updates)


def _row(args, env_cls, k, correction, objective, learner_overrides, curve, evals, t0) -> dict:
    """A cell's record (``accuracy`` and ``collapsed`` are added by the caller)."""
    return {"task": args.task, "letters": args.letters, "add_digits": args.add_digits, "chance": env_cls.chance(),
            "lr": args.lr, "schedule": args.schedule, "warmup": args.warmup,
            "retry_all_wrong": args.retry_all_wrong, "k": k, "correction": correction,
            "updates": args.updates, "seed": args.seed,
            "objective": objective.model_dump(mode="json"), "learner": learner_overrides,
            "wall_s": time.perf_counter() - t0, "curve": list(curve), "evals": list(evals)}  # fmt: skip


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=list(TASKS), default="copy")
    ap.add_argument("--letters", type=int, default=8, help="copy / shift tasks: alphabet size (<= 26)")
    ap.add_argument("--add-digits", type=int, default=5, help="add task: operands 0..N-1")
    ap.add_argument("--updates", type=int, default=4096)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 8, 64, 256])
    ap.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    ap.add_argument("--schedule", choices=["constant", "cosine"], default="constant",
                    help="cosine: warm-up then cosine decay to lr/10 at the last update")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=0, help="--schedule cosine: warm-up updates")
    ap.add_argument(
        "--retry-all-wrong", type=int, default=0, help="replay an all-wrong group's task up to N times"
    )
    ap.add_argument("--sft-steps", type=int, default=100)
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--eval-every", type=int, default=0, help="held-out eval period (0: updates / 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "staleness.json"))
    ap.add_argument("--render", nargs="+", metavar="JSON", help="merge finished runs from these result files "
                    "into --out and print the table, without training")  # fmt: skip
    args = ap.parse_args()
    if args.render:
        files = [json.loads(Path(f).read_text()) for f in args.render]
        rows = [r for d in files for r in d["runs"]]
        partial = [r for d in files for r in d.get("partial", [])]
        Path(args.out).write_text(
            json.dumps({"args": vars(args), "runs": rows, "partial": partial}, indent=2)
        )
        render(rows, Path(args.out))
        _partial_table(partial)
        return
    torch.set_num_threads(1)
    AddEnv.digits = args.add_digits
    CopyEnv.letters = string.ascii_uppercase[: args.letters]
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def write(partial: list[dict]) -> None:
        # Unfinished cells go under "partial" (their last intermediate eval), never under "runs".
        Path(args.out).write_text(
            json.dumps({"args": vars(args), "runs": rows, "partial": partial}, indent=2)
        )

    for k in args.ks:
        for c in args.corrections:
            rows.append(await one_run(k, c, args, on_eval=lambda r: write([r])))
            write([])
    render(rows, Path(args.out))


def render(rows: list[dict], out: Path) -> None:
    """Print the k x correction table per task (accuracy, ratio to on-policy) and plot it next to ``out``.

    Figure: final accuracy vs k per correction; held-out accuracy vs update per cell at
    the largest k (and on-policy); masked and clipped token fractions vs update at the largest k.
    """
    tasks = sorted({r.get("task", "copy") for r in rows})
    for task in tasks:
        _table(task, [r for r in rows if r.get("task", "copy") == task])
    plt = pyplot()

    fig, axes = plt.subplots(len(tasks), 3, figsize=(16, 4 * len(tasks)), squeeze=False)
    for (ax, ax_curve, ax_frac), task in zip(axes, tasks, strict=True):
        task_rows = [r for r in rows if r.get("task", "copy") == task]
        ks = sorted({r["k"] for r in task_rows})
        corrections = [c for c in CORRECTIONS if any(r["correction"] == c for r in task_rows)]
        for c in corrections:
            # Line through the mean over seeds at each k; a dot per run, so seeds that disagree show.
            pts = sorted((r["k"], r["accuracy"]) for r in task_rows if r["correction"] == c)
            cks = sorted({kk for kk, _ in pts})
            means = [sum(a for kk, a in pts if kk == k_) / sum(kk == k_ for kk, _ in pts) for k_ in cks]
            (line,) = ax.plot([max(k_, 0.5) for k_ in cks], means, "-", label=f"{c} (mean over seeds)")
            ax.plot([max(p[0], 0.5) for p in pts], [p[1] for p in pts], "o", color=line.get_color())
        ax.set_xscale("log")
        ax.axhline(task_rows[0].get("chance", 1 / len(LETTERS)), color="grey", ls=":", label="chance")
        ax.set_xlabel("forced staleness k (0 plotted at 0.5)")
        ax.set_ylabel(f"{task}: held-out accuracy after training")
        ax.legend(fontsize=8)
        for r in task_rows:
            if r["k"] == max(ks) or r["k"] == 0:
                evals = r.get("evals") or [
                    {"update": p["update"], "accuracy": p["reward"]} for p in r["curve"] if "reward" in p
                ]
                style = "--" if r["k"] == 0 else "-"
                ax_curve.plot(
                    [e["update"] for e in evals],
                    [e["accuracy"] for e in evals],
                    style,
                    label=f"k={r['k']} {r['correction']} seed {r.get('seed', 0)}",
                )
                if r["k"] != max(ks):
                    continue
                for key, ls in (("corrections/masked_frac", "-"), ("opsm/masked_frac", ":"),
                                ("policy/clip_high_frac", "--"), ("policy/clip_low_frac", "-.")):  # fmt: skip
                    pts = [(p["update"], p[key]) for p in r["curve"] if p.get(key) is not None]
                    if pts and any(v > 0 for _, v in pts):
                        ax_frac.plot(
                            *zip(*pts, strict=True), ls, label=f"{r['correction']} s{r.get('seed', 0)} {key}"
                        )
        ax_curve.set_xlabel("update")
        ax_curve.set_ylabel("held-out accuracy (batch reward for older runs)")
        ax_curve.legend(fontsize=7)
        ax_frac.set_xlabel("update")
        ax_frac.set_ylabel(f"token fraction at k={max(ks)}")
        if ax_frac.get_legend_handles_labels()[0]:
            ax_frac.legend(fontsize=6)
    save_figure(fig, out.with_suffix(".png"), dpi=100)


def _partial_table(partial: list[dict]) -> None:
    """Print the unfinished cells: held-out accuracy at the last intermediate eval they reached."""
    if not partial:
        return
    print("\nPARTIAL (unfinished: stopped before their last update; not in the table above)")
    for r in sorted(partial, key=lambda r: (r.get("task", "copy"), r["k"], r["correction"], r["seed"])):
        print(f"  {r.get('task', 'copy')} k={r['k']} {r['correction']} seed {r['seed']}: held-out "
              f"{r['accuracy']:.3f} at update {r['last_eval_update']} of {r['updates']}")  # fmt: skip


def _masked(point: dict) -> float | None:
    """Masked token fraction of a curve point (older result files only logged the kept fraction)."""
    if point.get("corrections/masked_frac") is not None:
        return point["corrections/masked_frac"]
    return None if point.get("kept_frac") is None else 1.0 - point["kept_frac"]


def _table(task: str, rows: list[dict]) -> None:
    ks = sorted({r["k"] for r in rows})
    corrections = [c for c in CORRECTIONS if any(r["correction"] == c for r in rows)]
    cell: dict[tuple[int, str], list[dict]] = {}
    for r in rows:
        cell.setdefault((r["k"], r["correction"]), []).append(r)
    on_policy = [r["accuracy"] for r in rows if r["k"] == 0]
    base = sum(on_policy) / len(on_policy) if on_policy else None
    # Cells of one seed share initial weights, warm start and prompts: compare with that seed's on-policy run.
    seed_base = {r.get("seed", 0): r["accuracy"] for r in rows if r["k"] == 0 and r["correction"] == "none"}
    print(f"\ntask {task}\n| k | " + " | ".join(corrections) + " |")
    print("|---|" + "---|" * len(corrections))
    for k in ks:
        cells = []
        for c in corrections:
            runs = cell.get((k, c))
            if not runs:
                cells.append("-")
                continue
            parts = []
            for r in runs:
                masked = [_masked(p) for p in r["curve"] if _masked(p) is not None]
                text = f"{r['accuracy']:.3f}"
                ref = seed_base.get(r.get("seed", 0), base)
                if ref:
                    text += f" ({r['accuracy'] / ref:.0%})"
                if masked and any(masked):
                    text += f", masked {sum(masked) / len(masked):.2f}"
                learned = next((p["update"] for p in r["curve"] if p.get("reward", 0.0) >= 0.9), None)
                text += f", >=0.9 @ {learned}" if learned is not None else ", never >=0.9"
                parts.append(text + (" collapsed" if r["collapsed"] else ""))
            cells.append(" / ".join(parts))
        print(f"| {k} | " + " | ".join(cells) + " |")
    if base is not None:
        print(f"on-policy (k=0) accuracy, mean over its runs: {base:.3f}; (x%) = ratio to the on-policy")
        print("run (k=0, none) of the same seed, or to that mean where the seed has none")
    print("masked = mean fraction of tokens the batch-level masks removed at the logged updates;")
    print(">=0.9 @ = first logged update whose batch reward reached 0.9; ' / ' separates seeds")


if __name__ == "__main__":
    asyncio.run(main())
