"""Tiny-shape ``train_step`` tokens/s of whichever labrl comes first on ``sys.path``: the A/B of the
learner's host-copy change (commit 35e7d12) on one GPU node, old and new installed side by side
(``tiny_host_copies_ab.sh``). Run from the repository root."""

import json
import sys

sys.path.insert(0, "benchmarks")  # gpu_learner's benches, beside it

from gpu_learner import QUICKSTART_MODEL, bench_labrl, bench_megatron, peak_tflops

import labrl.harness.objectives as objectives

code = "new" if hasattr(objectives, "host_metrics") else "old"
peak = peak_tflops()
for experts in ("grouped_mm", "sequential"):
    row = bench_labrl(QUICKSTART_MODEL, 64, 200, 32, 20, peak, experts)
    line = {"code": code, "experts": experts, "tokens_per_s": round(row["tokens_per_s"]),
            "separate_proximal": round(row["separate_proximal_forward_tokens_per_s"])}  # fmt: skip
    print(json.dumps(line), flush=True)
if code == "new":
    row = bench_megatron(QUICKSTART_MODEL, 64, 200, 32, 20, peak, "grouped_mm")
    line = {"code": "bare megatron", "experts": "grouped_mm", "tokens_per_s": round(row["tokens_per_s"])}
    print(json.dumps(line), flush=True)
