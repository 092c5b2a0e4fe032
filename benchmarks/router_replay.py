"""Router replay (R3) on the tiny MoE: bf16 sampler vs fp32 learner, with and without replay.

For each of N batches: the bf16 LocalSampler generates, the fp32 learner
recomputes log-probs of the same tokens (a) routing on its own and (b)
replaying the sampler's routed experts. Reported per mode, over all
loss-mask tokens of all batches:

- mismatch KL k3 = mean(r - 1 - log r), r = pi_learner / pi_sampler, per token;
- routing mismatch: fraction of tokens whose expert set differs from the
  sampler's in at least one MoE layer (learner's own routing; with replay the
  learner uses the sampler's experts by construction);
- IS-ratio spread: std and 1%/99% quantiles of r.

The model is randomly initialised (seed 0) unless --train-steps N first
trains it N REINFORCE steps on random rewards (to move it off init).

    .venv/bin/python benchmarks/router_replay.py --batches 50
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from _results import save_histograms, write_json  # beside this script
from _torch_threads import parse_with_threads  # beside this script

from labrl.harness.learners import LearnerConfig, MegatronLearner
from labrl.harness.models import get_preset
from labrl.harness.rollout.batching import collate
from labrl.harness.samplers import LocalSampler, LocalSamplerConfig
from labrl.harness.types import GenerateRequest, SamplingParams, Trajectory


def make_batch(sampler: LocalSampler, batch_size: int, prompt_len: int, new_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    reqs = [
        GenerateRequest(
            rid=f"{seed}-{i}",
            input_ids=tuple(torch.randint(0, 256, (prompt_len,), generator=gen).tolist()),
            sampling=SamplingParams(max_new_tokens=new_tokens, seed=seed * 1000 + i),
            return_routed_experts=True,
        )
        for i in range(batch_size)
    ]
    results = asyncio.run(sampler.generate(reqs))
    trajs = [
        Trajectory(
            env_id="bench/random-v0",
            task_id=r.rid,
            group_id=str(i // 4),
            tokens_T=[*r.input_ids, *o.output_ids],
            loss_mask_T=[0] * len(r.input_ids) + [1] * len(o.output_ids),
            logprobs_T=[0.0] * len(r.input_ids) + o.logprobs_T,
            versions_T=[-1] * len(r.input_ids) + o.versions_T,
            reward=float(torch.rand((), generator=gen) < 0.5),
            outcome="ok",
            finish_reason=o.finish_reason,
            num_turns=1,
            routed_experts_T_L_K=o.routed_experts_T_L_K,
        )
        for i, (r, o) in enumerate(zip(reqs, results, strict=True))
    ]
    return collate(trajs, pad_token_id=256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--train-steps", type=int, default=0)
    args = parse_with_threads(ap, default=2)
    started = time.perf_counter()
    learner = MegatronLearner(LearnerConfig(micro_batch_size=16, objective={"loss": "reinforce"}))
    sampler = LocalSampler(get_preset("tiny-moe"), LocalSamplerConfig(precision="bf16"))
    for step in range(args.train_steps):
        asyncio.run(sampler.update_weights(learner.export_weights(), learner.version))
        learner.train_step(
            make_batch(sampler, args.batch_size, args.prompt_len, args.new_tokens, 10_000 + step)
        )
    asyncio.run(sampler.update_weights(learner.export_weights(), learner.version))

    log_r = {"no_replay": [], "replay": []}
    routing_diff, routed_tokens = 0, 0
    for i in range(args.batches):
        batch = make_batch(sampler, args.batch_size, args.prompt_len, args.new_tokens, i)
        mask = batch.loss_mask_B_T
        behaviour = batch.behaviour_logprobs_B_T
        log_r["no_replay"].append((learner.logprobs(batch.tokens_B_T) - behaviour)[mask])
        log_r["replay"].append(
            (learner.logprobs(batch.tokens_B_T, batch.routed_experts_B_T_L_K) - behaviour)[mask]
        )
        # routing over real tokens except each row's last (its row is padding, as in SGLang)
        real = batch.attention_mask_B_T.clone()
        real[torch.arange(batch.batch_size), batch.attention_mask_B_T.sum(1) - 1] = False
        own = learner.route(batch.tokens_B_T).sort(-1).values
        differs = (own != batch.routed_experts_B_T_L_K.sort(-1).values).any(-1).any(-1)
        routing_diff += int(differs[real].sum())
        routed_tokens += int(real.sum())

    report = {}
    for mode, chunks in log_r.items():
        lr = torch.cat(chunks).double()
        r = lr.exp()
        report[mode] = {
            "mismatch_kl_k3": float((r - 1 - lr).mean()),
            "is_ratio_std": float(r.std()),
            "is_ratio_q01": float(torch.quantile(r, 0.01)),
            "is_ratio_q99": float(torch.quantile(r, 0.99)),
            "max_abs_log_ratio": float(lr.abs().max()),
            "tokens": int(lr.numel()),
        }
    report["no_replay"]["routing_mismatch_frac"] = routing_diff / routed_tokens
    report["replay"]["routing_mismatch_frac"] = 0.0  # the routers are handed the sampler's experts
    ratio = report["no_replay"]["mismatch_kl_k3"] / report["replay"]["mismatch_kl_k3"]
    meta = {
        "model": "tiny-moe", "init": "random (seed 0)" if args.train_steps == 0 else f"{args.train_steps} REINFORCE steps",
        "sampler": "LocalSampler bf16", "learner": "MegatronLearner fp32", "batches": args.batches,
        "batch_size": args.batch_size, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "routed_tokens": routed_tokens, "kl_reduction_x": ratio, "wall_s": time.perf_counter() - started,
    }  # fmt: skip
    print(f"{'mode':<10} {'KL k3':>10} {'route diff':>11} {'IS std':>8} {'IS q01':>8} {'IS q99':>8}")
    for mode in ("no_replay", "replay"):
        m = report[mode]
        print(
            f"{mode:<10} {m['mismatch_kl_k3']:>10.3e} {m['routing_mismatch_frac']:>11.4f} "
            f"{m['is_ratio_std']:>8.4f} {m['is_ratio_q01']:>8.4f} {m['is_ratio_q99']:>8.4f}"
        )
    print(f"router replay cuts mismatch KL by {ratio:.2f}x ({meta['wall_s']:.0f} s)")
    write_json("router_replay", {"meta": meta, **report})
    save_histograms(
        "router_replay",
        {mode: torch.cat(log_r[mode]).numpy() for mode in ("no_replay", "replay")},
        xlabel="log(pi_learner fp32 / pi_sampler bf16) per token",
        title=f"tiny-moe: router replay cuts mismatch KL {ratio:.1f}x",
        colors={"no_replay": "tab:red", "replay": "tab:blue"},
        bins=80,
        alpha=0.6,
        log=True,
    )


if __name__ == "__main__":
    main()
