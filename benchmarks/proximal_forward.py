"""train_step with and without the separate no-grad proximal forward (issue 26), tiny MoE on CPU.

Two learners with the same weights, one with ``learner.proximal_forward=separate``
(the path before issue 26: a no-grad forward over the batch, then the loss
forward and backward), one with ``auto`` (the loss forward's log-probs,
detached, are the proximal ones: ``labrl.harness.learners.proximal``). Their
steps alternate on the same batch, so both see the same machine load; the
ratio of the medians is the result. Rows: one micro-batch (any objective),
two micro-batches with the default objective (TIS: no whole-batch term), and
two micro-batches with the quickstart's objective (CISPO, M2PO, KL to a frozen
reference: a whole-batch term, so ``auto`` runs both loss forwards first and
keeps their graphs: ``labrl.harness.learners.graph_memory``; the row also gives
the kept graphs' saved bytes).
Prompts of 234 random tokens plus 16 scored ones; behaviour log-probs are the
learner's own (on-policy).

    .venv/bin/python benchmarks/proximal_forward.py [--repeats 5] [--batch 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from _quickstart import quickstart_learner_fields  # beside this script
from _results import write_json  # beside this script
from _torch_threads import parse_with_threads  # beside this script

from labrl.harness.learners import LearnerConfig, MegatronLearner
from labrl.harness.rollout.batching import collate
from labrl.harness.types import TrainBatch, Trajectory

PROMPT, SCORED = 234, 16
# configs/quickstart.yaml's objective and reference
QUICKSTART_OBJECTIVE = quickstart_learner_fields()


def make_batch(learner: MegatronLearner, batch: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    trajs = [
        Trajectory(
            env_id="bench/random-v0",
            task_id=str(i),
            group_id=str(i // 8),
            tokens_T=torch.randint(0, 256, (PROMPT + SCORED,), generator=gen).tolist(),
            loss_mask_T=[0] * PROMPT + [1] * SCORED,
            logprobs_T=[0.0] * (PROMPT + SCORED),
            versions_T=[-1] * PROMPT + [0] * SCORED,
            reward=float(i % 2),
            outcome="ok",
            finish_reason="length",
            num_turns=1,
        )
        for i in range(batch)
    ]
    out = collate(trajs, pad_token_id=256)
    on_policy = learner.logprobs(out.tokens_B_T)
    return dataclasses.replace(out, behaviour_logprobs_B_T=torch.where(out.loss_mask_B_T, on_policy, 0.0))


def compare(batch_size: int, micro_batch_size: int, repeats: int, **learner: object) -> dict[str, float]:
    base = LearnerConfig(micro_batch_size=micro_batch_size, **learner)
    one = MegatronLearner(base)
    two = MegatronLearner(base.model_copy(update={"proximal_forward": "separate"}))
    batch = make_batch(one, batch_size)
    times: dict[str, list[float]] = {"separate": [], "auto": []}
    kept = 0.0
    for _ in range(repeats + 1):  # the first pair warms up
        for name, stepping in (("separate", two), ("auto", one)):
            t0 = time.perf_counter()
            m = stepping.train_step(batch)
            times[name].append(time.perf_counter() - t0)
            assert m["learner/proximal_forward"] == float(name == "separate")
            kept = max(kept, m["learner/kept_graph_bytes"])
    sep, auto = statistics.median(times["separate"][1:]), statistics.median(times["auto"][1:])
    return {
        "separate_step_s": sep,
        "auto_step_s": auto,
        "speedup_x": sep / auto,
        "kept_graph_mib": kept / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    args = parse_with_threads(ap, default=2)
    rows = {
        f"one_micro_batch_{args.batch}x{PROMPT + SCORED}": compare(args.batch, args.batch, args.repeats),
        f"two_micro_batches_{args.batch}x{PROMPT + SCORED}_tis": compare(
            args.batch, args.batch // 2, args.repeats
        ),
        f"two_micro_batches_{args.batch}x{PROMPT + SCORED}_m2po_kl_kept_graphs": compare(
            args.batch, args.batch // 2, args.repeats, **QUICKSTART_OBJECTIVE
        ),
    }
    print(f"{'case':<48} {'separate s':>11} {'auto s':>9} {'speedup':>8} {'kept MiB':>9}")
    for name, r in rows.items():
        print(
            f"{name:<48} {r['separate_step_s']:>11.3f} {r['auto_step_s']:>9.3f} {r['speedup_x']:>7.2f}x"
            f" {r['kept_graph_mib']:>9.1f}"
        )
    write_json("proximal_forward", rows)


if __name__ == "__main__":
    main()
