"""Objectives benchmark: cost of ``prepare`` + ``policy_loss`` and how much each correction masks.

Part 1 times one learner step's objective work (``prepare`` once, then
forward+backward of ``policy_loss`` over micro-batches) on synthetic
log-probs, against a baseline measured in the same run: a bare token-mean
REINFORCE loss on the same tensors. The CPU is shared, so read the ratios, not
the absolute times.

Part 2 draws behaviour log-ratios ``log w ~ N(0, sigma^2)`` (a stand-in for
growing staleness / mismatch) and reports the fraction of tokens each
correction keeps, the ESS and the mismatch KL.

    .venv/bin/python benchmarks/objectives_bench.py [--tokens 262144] [--repeats 3]

Prints two tables and writes benchmarks/results/objectives.json and objectives_masking.png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from _results import RESULTS, pyplot, save_figure, write_json  # beside this script

from labrl.harness.objectives import (
    M2PO,
    TIS,
    GeoMask,
    ObjectiveConfig,
    ObjectiveInputs,
    TokenMask,
    Veto,
    policy_loss,
    prepare,
)


def synthetic(B: int, T: int, sigma: float, seed: int = 0) -> tuple[ObjectiveInputs, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    mask = torch.rand(B, T, generator=g) > 0.1
    mu = old - sigma * torch.randn(B, T, generator=g)
    versions = torch.where(mask, torch.randint(0, 17, (B, T), generator=g), -1)
    inputs = ObjectiveInputs(
        loss_mask_B_T=mask,
        old_logprobs_B_T=old,
        behaviour_logprobs_B_T=mu,
        versions_B_T=versions,
        rewards_B=torch.rand(B, generator=g),
        group_ids_B=torch.arange(B) // 8,
        learner_version=16,
    )
    logp = old + 0.05 * torch.randn(B, T, generator=g)
    return inputs, logp


def _time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_cost(tokens: int, repeats: int, micro: int = 4) -> list[dict]:
    T = 1024
    B = max(tokens // T, micro)
    inputs, logp0 = synthetic(B, T, sigma=0.3)
    chunks = torch.arange(B).chunk(micro)

    def baseline() -> None:
        for rows in chunks:
            logp = logp0[rows].clone().requires_grad_(True)
            adv = inputs.rewards_B[rows, None]
            m = inputs.loss_mask_B_T[rows]
            (torch.where(m, -adv * logp, 0.0).sum() / inputs.loss_mask_B_T.sum()).backward()

    configs = {
        "reinforce, no corrections": ObjectiveConfig(loss="reinforce", corrections=[]),
        "cispo + tis (default)": ObjectiveConfig(),
        "ppo + tis + token_mask": ObjectiveConfig(loss="ppo", corrections=[TIS(), TokenMask()]),
        "gspo + geo_mask + veto": ObjectiveConfig(loss="gspo", corrections=[GeoMask(), Veto()]),
        "cispo + all five": ObjectiveConfig(
            corrections=[TIS(), TokenMask(), GeoMask(low=0.5, high=2.0), Veto(), M2PO()]
        ),
    }
    base = _time(baseline, repeats)
    rows = [{"config": "bare REINFORCE loss (baseline)", "seconds": base, "ratio": 1.0}]
    for name, cfg in configs.items():

        def step(cfg: ObjectiveConfig = cfg) -> None:
            prepared = prepare(cfg, inputs)
            for idx in chunks:
                logp = logp0[idx].clone().requires_grad_(True)
                policy_loss(cfg, logp, prepared.select(idx))[0].backward()

        prep = _time(lambda cfg=cfg: prepare(cfg, inputs), repeats)
        sec = _time(step, repeats)
        rows.append({"config": name, "seconds": sec, "prepare_seconds": prep, "ratio": sec / base})
    return rows


def bench_masking(tokens: int) -> list[dict]:
    T = 512
    B = max(tokens // T, 8)
    out = []
    for sigma in (0.05, 0.1, 0.2, 0.4, 0.8):
        inputs, _ = synthetic(B, T, sigma=sigma, seed=1)
        cfg = ObjectiveConfig(corrections=[TIS(), TokenMask(), GeoMask(), Veto(), M2PO()])
        m = prepare(cfg, inputs).metrics
        out.append(
            {
                "sigma": sigma,
                "kl_k3": m["mismatch/kl_k3"],
                "ess": m["mismatch/ess"],
                "tis_truncated": m["tis_token/truncated_frac"],
                "token_mask": m["token_mask/masked_frac"],
                "geo_mask": m["geo_mask/masked_frac"],
                "veto": m["veto/masked_frac"],
                "m2po": m["m2po/masked_frac"],
                "kept": m["corrections/kept_frac"],
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=262_144)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    cost = bench_cost(args.tokens, args.repeats)
    print(
        f"objective cost per step, {args.tokens} tokens, 4 micro-batches, 1 thread (best of {args.repeats})"
    )
    print(f"{'config':34s} {'step s':>8s} {'prepare s':>10s} {'x baseline':>11s}")
    for r in cost:
        prep = f"{r['prepare_seconds']:.3f}" if "prepare_seconds" in r else "-"
        print(f"{r['config']:34s} {r['seconds']:8.3f} {prep:>10s} {r['ratio']:11.2f}")

    masking = bench_masking(args.tokens)
    print("\nfraction of valid tokens removed per correction (applied in this order), log w ~ N(0, sigma^2)")
    keys = ["kl_k3", "ess", "tis_truncated", "token_mask", "geo_mask", "veto", "m2po", "kept"]
    print(f"{'sigma':>6s} " + " ".join(f"{k:>13s}" for k in keys))
    for r in masking:
        print(f"{r['sigma']:6.2f} " + " ".join(f"{r[k]:13.4f}" for k in keys))

    path = write_json("objectives", {"tokens": args.tokens, "cost": cost, "masking": masking})
    png = RESULTS / "objectives_masking.png"
    plot_masking(masking, png)
    print(f"\nwrote {path} and {png}")


def plot_masking(masking: list[dict], path: Path) -> None:
    plt = pyplot()

    sigmas = [r["sigma"] for r in masking]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in ("tis_truncated", "token_mask", "geo_mask", "veto", "m2po"):
        ax.plot(sigmas, [r[key] for r in masking], marker="o", label=key)
    ax.plot(sigmas, [r["ess"] for r in masking], "k--", label="ESS")
    ax.set_xscale("log")
    ax.set_xlabel("sigma of log w (behaviour mismatch)")
    ax.set_ylabel("fraction of valid tokens")
    ax.set_title("tokens truncated (TIS) or removed (masks), applied in order")
    ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
