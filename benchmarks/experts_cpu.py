"""SequentialMLP vs TorchGroupedMLP (``learner.experts``) on CPU, on the quickstart's model.

Decides ``labrl.harness.models.device.experts_module``'s CPU choice: grouped_mm is
chosen on CPU only if it is not slower. Two measurements, each as a ratio of the
two modules timed interleaved in the same run (a shared machine's load hits both
alike), on the quickstart's tiny MoE (2 layers, hidden 96, 4 experts top-2, fp32):

- ``train_step``: ``MegatronLearner.train_step`` on a quickstart-sized batch
  (32 rows of 200 tokens, micro-batch 32);
- ``decode``: a no-grad forward of the model on 64 sequences of one token (the
  local sampler's decode step shape, without the KV cache);
- ``experts N=...``: the first MoE layer's experts module alone, no-grad forward and
  forward + backward, on N token rows spread evenly over the 4 experts: N = 12800 is
  a training micro-batch (32 x 200 tokens, top-2), N = 128 a decode step (64 x top-2).

    .venv/bin/python benchmarks/experts_cpu.py            # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _results import write_json  # beside this script
from gpu_learner import QUICKSTART_MODEL, synthetic_batch

from labrl._warnings import quiet_expected_warnings
from labrl.harness.learners import LearnerConfig, MegatronLearner
from labrl.harness.models import build_gpt_model, causal_attention_mask

MODULES = {"sequential": "SequentialMLP", "grouped_mm": "TorchGroupedMLP"}


def interleaved(fns: dict[str, callable], repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved, after one warm-up each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {k: statistics.median(v) for k, v in times.items()}


def train_steps(repeats: int) -> dict[str, float]:
    batch = synthetic_batch(QUICKSTART_MODEL, 32, 200)
    learners = {
        e: MegatronLearner(
            LearnerConfig(model=QUICKSTART_MODEL, micro_batch_size=32, router_replay=False, experts=e)
        )
        for e in MODULES
    }
    return interleaved({e: (lambda lr=lr: lr.train_step(batch)) for e, lr in learners.items()}, repeats)


def decode_forwards(repeats: int) -> dict[str, float]:
    models = {e: build_gpt_model(QUICKSTART_MODEL, experts=e).eval() for e in MODULES}
    tokens = torch.randint(0, 256, (64, 1))
    positions = torch.zeros(64, 1, dtype=torch.long)
    mask = causal_attention_mask(1)

    def forward(model):
        with torch.no_grad():
            model(input_ids=tokens, position_ids=positions, attention_mask=mask)

    return interleaved({e: (lambda m=m: forward(m)) for e, m in models.items()}, repeats)


def experts_alone(rows: int, repeats: int) -> dict[str, dict[str, float]]:
    modules = {e: build_gpt_model(QUICKSTART_MODEL, experts=e).decoder.layers[0].mlp.experts for e in MODULES}
    experts = QUICKSTART_MODEL.num_experts
    counts = torch.full((experts,), rows // experts)
    x = torch.randn(rows // experts * experts, QUICKSTART_MODEL.hidden_size, requires_grad=True)
    probs = torch.rand(x.shape[0])

    def forward(module):
        with torch.no_grad():
            module(x, counts, probs)

    def forward_backward(module):
        out, _ = module(x, counts, probs)
        out.sum().backward()

    return {
        "forward": interleaved({e: (lambda m=m: forward(m)) for e, m in modules.items()}, repeats),
        "forward_backward": interleaved(
            {e: (lambda m=m: forward_backward(m)) for e, m in modules.items()}, repeats
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    quiet_expected_warnings()
    torch.set_num_threads(2)
    result = {"model": QUICKSTART_MODEL.name, "threads": torch.get_num_threads()}
    for name, bench, repeats in (
        ("train_step", train_steps, args.repeats),
        ("decode", decode_forwards, 20 * args.repeats),
    ):
        seconds = bench(repeats)
        result[name] = {
            "seconds": {MODULES[e]: s for e, s in seconds.items()},
            "grouped_over_sequential_time": seconds["grouped_mm"] / seconds["sequential"],
        }
        print(name, json.dumps(result[name]), flush=True)
    for rows in (128, 12800):
        for mode, seconds in experts_alone(rows, 10 * args.repeats).items():
            name = f"experts N={rows} {mode}"
            result[name] = {
                "seconds": {MODULES[e]: s for e, s in seconds.items()},
                "grouped_over_sequential_time": seconds["grouped_mm"] / seconds["sequential"],
            }
            print(name, json.dumps(result[name]), flush=True)
    print(f"wrote {write_json('experts_cpu', result)}")


if __name__ == "__main__":
    main()
