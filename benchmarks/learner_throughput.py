"""Throughput of the tiny MoE on CPU: LocalSampler tokens/s and MegatronLearner step time.

Sampler: batch 64, prompt 200 tokens, 16 new tokens, fp32 and bf16, with the
KV cache, against a no-cache baseline measured in the same run (full forward
over the growing sequence per token). Learner: one train_step on 64 x 250
tokens (234-token prompt + 16 generated). CPU is shared with other work: the
ratios matter more than the absolute numbers.

    .venv/bin/python benchmarks/learner_throughput.py
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from _results import write_json  # beside this script
from _torch_threads import parse_with_threads  # beside this script

from labrl.harness.learners import LearnerConfig, MegatronLearner
from labrl.harness.models import causal_attention_mask, get_preset
from labrl.harness.rollout.batching import collate
from labrl.harness.samplers import LocalSampler, LocalSamplerConfig
from labrl.harness.types import GenerateRequest, SamplingParams, Trajectory


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = parse_with_threads(ap, default=2)
    cfg = get_preset("tiny-moe")
    learner = MegatronLearner(LearnerConfig(micro_batch_size=16))
    gen = torch.Generator().manual_seed(0)
    reqs = [
        GenerateRequest(
            rid=str(i),
            input_ids=tuple(torch.randint(0, 256, (200,), generator=gen).tolist()),
            sampling=SamplingParams(max_new_tokens=16, seed=i, stop_token_ids=()),
            return_routed_experts=True,
        )
        for i in range(64)
    ]
    out: dict[str, float] = {}
    for precision in ("fp32", "bf16"):
        sampler = LocalSampler(cfg, LocalSamplerConfig(precision=precision), weights=learner.export_weights())
        asyncio.run(sampler.generate(reqs[:4]))  # warm up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            results = asyncio.run(sampler.generate(reqs))
            times.append(time.perf_counter() - t0)
        best = min(times)
        out[f"sampler_{precision}_tokens_per_s"] = 64 * 16 / best
        out[f"sampler_{precision}_batch_s"] = best
        out[f"sampler_{precision}_prefill_s"] = results[0].info["prefill_s"]
    # no-cache baseline: a full forward over the growing sequences for every new token (greedy)
    model = learner.model
    ids = torch.tensor([r.input_ids for r in reqs])
    t0 = time.perf_counter()
    with torch.no_grad():
        model.eval()
        for _ in range(16):
            T = ids.shape[1]
            logits = model(
                input_ids=ids,
                position_ids=torch.arange(T).expand(64, T),
                attention_mask=causal_attention_mask(T),
            )
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        model.train()
    out["no_cache_fp32_batch_s"] = time.perf_counter() - t0
    out["kv_cache_speedup_x"] = out["no_cache_fp32_batch_s"] / out["sampler_fp32_batch_s"]
    trajs = [
        Trajectory(
            env_id="bench/random-v0",
            task_id=str(i),
            group_id=str(i // 8),
            tokens_T=[*torch.randint(0, 256, (234,), generator=gen).tolist(), *res.output_ids],
            loss_mask_T=[0] * 234 + [1] * 16,
            logprobs_T=[0.0] * 234 + res.logprobs_T,
            versions_T=[-1] * 234 + res.versions_T,
            reward=float(i % 2),
            outcome="ok",
            finish_reason="length",
            num_turns=1,
        )
        for i, res in enumerate(results)
    ]
    batch = collate(trajs, pad_token_id=256)
    learner.train_step(batch)  # warm up
    steps = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        learner.train_step(batch)
        steps.append(time.perf_counter() - t0)
    out["learner_step_s_64x250"] = min(steps)
    out["learner_tokens_per_s"] = 64 * 250 / min(steps)
    out["parameters"] = float(learner.num_parameters)
    for k, v in out.items():
        print(f"{k:<32} {v:>12.3f}")
    write_json("learner_throughput", out)


if __name__ == "__main__":
    main()
