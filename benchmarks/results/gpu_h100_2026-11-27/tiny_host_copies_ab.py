"""Tiny-shape labrl train_step tokens/s with whichever labrl is first on sys.path (old vs new, same node)."""
import sys, time, json
sys.path.insert(0, "benchmarks")
import torch
from gpu_learner import QUICKSTART_MODEL, bench_labrl, bench_megatron, peak_tflops
import labrl.harness.objectives as O
tag = "new" if hasattr(O, "host_metrics") else "old"
peak = peak_tflops()
for experts in ("grouped_mm", "sequential"):
    r = bench_labrl(QUICKSTART_MODEL, 64, 200, 32, 20, peak, experts)
    print(json.dumps({"code": tag, "experts": experts, "tokens_per_s": round(r["tokens_per_s"]),
                      "separate_proximal": round(r["separate_proximal_forward_tokens_per_s"])}), flush=True)
if tag == "new":
    r = bench_megatron(QUICKSTART_MODEL, 64, 200, 32, 20, peak, "grouped_mm")
    print(json.dumps({"code": "bare megatron", "experts": "grouped_mm", "tokens_per_s": round(r["tokens_per_s"])}), flush=True)
