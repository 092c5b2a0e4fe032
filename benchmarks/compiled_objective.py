"""The per-micro-batch objective eager and compiled (``learner.objective_kernel``), side by side.

Times ``policy_loss`` forward and backward on one micro-batch of synthetic log-probs, at the micro-batch
shapes of ``step_profile.py`` (the tiny MoE's 32 x 200, the 64-expert shape's 2 x 2048), a larger
one and 2 x 8 (no work: each call's host cost alone), under the learner's default objective and the quickstart configs' (M2PO and a KL term), eager
and through ``torch.compile`` (``objectives.compiled_loss_terms``), in the same run. The compile's
own time (the first call) is reported apart and left out of the timing. The ratio is eager / compiled:
above 1, compiling is faster.

    .venv/bin/python benchmarks/compiled_objective.py                  # CPU, 1 thread (~1 min)
    python3 benchmarks/compiled_objective.py --device cuda             # on a GPU node (gpu_check.sh)

Prints a table and writes benchmarks/results/compiled_objective_<device>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _quickstart import quickstart_objective
from _results import RESULTS  # beside this script
from _timing import device_sync
from _torch_threads import one_thread_on_cpu
from objectives_bench import synthetic

from labrl.harness.objectives import ObjectiveConfig, batch_terms, policy_loss, prepare

# "no work": 16 tokens, so a call's time is its host cost (dispatch and launches eager; guards,
# wrappers and the fused kernels compiled), what a launch-bound GPU step pays
SHAPES = {
    "no work": (2, 8),
    "tiny micro-batch": (32, 200),
    "64-expert micro-batch": (2, 2048),
    "large": (16, 2048),
}
OBJECTIVES = {
    "default": ObjectiveConfig(),
    "quickstart": quickstart_objective(),
}


def per_call_ms(fn: Callable[[], None], device: torch.device, *, repeats: int, calls: int) -> float:
    """Best over ``repeats`` of the mean time of ``calls`` calls, the device synchronised around each run."""
    best = float("inf")
    sync = device_sync(device)
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e3


def measure(name: str, cfg: ObjectiveConfig, B: int, T: int, device: torch.device, repeats: int) -> dict:
    inputs, logp0 = synthetic(B, T, sigma=0.3)
    if cfg.kl_coef > 0:
        inputs = dataclasses.replace(inputs, ref_logprobs_B_T=inputs.old_logprobs_B_T - 0.1)
    inputs = inputs.to(device)
    prepared = prepare(cfg, inputs, batch_terms(cfg, inputs.batch))
    logp0 = logp0.to(device)

    def step(compiled: bool) -> Callable[[], None]:
        def run() -> None:
            logp = logp0.clone().requires_grad_(True)
            loss, _ = policy_loss(cfg, logp, prepared, device_metrics=True, compiled=compiled)
            loss.backward()

        return run

    t0 = time.perf_counter()
    step(True)()  # compiles (a later shape of the same config reuses the graph: dynamic sizes)
    device_sync(device)()
    first_s = time.perf_counter() - t0
    step(False)()  # warm-up
    calls = 20 if device.type == "cuda" or B * T <= 8192 else 5
    eager = per_call_ms(step(False), device, repeats=repeats, calls=calls)
    compiled = per_call_ms(step(True), device, repeats=repeats, calls=calls)
    return {
        "objective": name,
        "B": B,
        "T": T,
        "eager_ms": eager,
        "compiled_ms": compiled,
        "eager_over_compiled": eager / compiled,
        "first_compiled_call_s": first_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("compiled_objective: no CUDA device here")
        return 0
    out_path = args.out or RESULTS / f"compiled_objective_{device.type}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"policy_loss forward + backward per micro-batch on {device} (best of {args.repeats})")
    print(
        f"{'objective':11} {'B x T':>10} {'eager ms':>9} {'compiled ms':>12} {'eager/compiled':>15} {'1st call s':>11}"
    )
    with one_thread_on_cpu(device):
        for name, cfg in OBJECTIVES.items():
            for B, T in SHAPES.values():
                r = measure(name, cfg, B, T, device, args.repeats)
                rows.append(r)
                print(f"{name:11} {f'{B} x {T}':>10} {r['eager_ms']:9.3f} {r['compiled_ms']:12.3f} "
                      f"{r['eager_over_compiled']:15.2f} {r['first_compiled_call_s']:11.1f}")  # fmt: skip
                # after every row: a run stopped at its time limit keeps what it measured
                out_path.write_text(
                    json.dumps({"device": str(device), "torch": torch.__version__, "rows": rows}, indent=1)
                )
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
