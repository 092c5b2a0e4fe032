"""LocalSampler scheduling: continuous batching vs waves, many small concurrent generate calls.

PipelineRL-like load on the tiny MoE (fp32, CPU): ``--requests`` single-request
``generate`` calls, prompts of 40-160 tokens, 2-32 new tokens each (uniform),
arriving either all at once (``burst``) or one every ``--gap-ms`` (``stream``).
Both schedulers run in the same process on the same weights, alternating, so
CPU contention from other work hits both; compare the ratios. Reported per
run: output tokens/s over the makespan, per-request latency (call -> result)
mean / p50 / p90, and the number of decode forwards.

    .venv/bin/python benchmarks/sampler_batching.py [--requests 96] [--repeats 2]

Writes benchmarks/results/sampler_batching.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import torch
from _results import RESULTS, pyplot, save_figure, write_json  # beside this script
from _torch_threads import parse_with_threads  # beside this script

from labrl.harness.models import get_preset
from labrl.harness.samplers import LocalSampler, LocalSamplerConfig
from labrl.harness.types import GenerateRequest, SamplingParams


def make_requests(n: int, seed: int) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = int(torch.randint(40, 161, (1,), generator=gen))
        new = int(torch.randint(2, 33, (1,), generator=gen))
        out.append(
            GenerateRequest(
                rid=f"r{i}",
                input_ids=tuple(torch.randint(0, 256, (prompt,), generator=gen).tolist()),
                sampling=SamplingParams(max_new_tokens=new, seed=i, stop_token_ids=()),
                return_routed_experts=True,
            )
        )
    return out


async def run_load(sampler: LocalSampler, reqs: list[GenerateRequest], gap_s: float) -> dict[str, float]:
    latencies: list[float] = []

    async def one(req: GenerateRequest) -> int:
        t0 = time.perf_counter()
        (res,) = await sampler.generate([req])
        latencies.append(time.perf_counter() - t0)
        return len(res.output_ids)

    steps0 = sampler.decode_steps
    t0 = time.perf_counter()
    tasks = []
    for req in reqs:
        tasks.append(asyncio.create_task(one(req)))
        if gap_s:
            await asyncio.sleep(gap_s)
    tokens = sum(await asyncio.gather(*tasks))
    makespan = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=10)
    return {
        "tokens_per_s": tokens / makespan,
        "makespan_s": makespan,
        "latency_mean_s": statistics.fmean(latencies),
        "latency_p50_s": statistics.median(latencies),
        "latency_p90_s": q[8],
        "decode_forwards": sampler.decode_steps - steps0,
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--gap-ms", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=2)
    args = parse_with_threads(ap, default=2)
    cfg = get_preset("tiny-moe")
    reqs = make_requests(args.requests, seed=0)
    samplers = {
        s: LocalSampler(cfg, LocalSamplerConfig(scheduling=s, max_batch_size=args.max_batch_size))
        for s in ("waves", "continuous")
    }
    for sampler in samplers.values():
        asyncio.run(run_load(sampler, reqs[:4], 0.0))  # warm up
    rows: dict[str, dict[str, list[dict[str, float]]]] = {"burst": {}, "stream": {}}
    for _ in range(args.repeats):
        for load, gap in (("burst", 0.0), ("stream", args.gap_ms / 1000)):
            for name, sampler in samplers.items():
                rows[load].setdefault(name, []).append(asyncio.run(run_load(sampler, reqs, gap)))
    summary: dict[str, dict[str, dict[str, float]]] = {}
    print(
        f"{args.requests} requests, max_batch_size {args.max_batch_size}, best of {args.repeats} (by makespan)"
    )
    print(
        f"{'load':7} {'scheduling':11} {'tok/s':>7} {'makespan':>9} {'lat mean':>9} {'p50':>7} {'p90':>7} {'fwds':>6}"
    )
    for load, by_sched in rows.items():
        summary[load] = {}
        for name, runs in by_sched.items():
            best = min(runs, key=lambda r: r["makespan_s"])
            summary[load][name] = best
            print(
                f"{load:7} {name:11} {best['tokens_per_s']:7.1f} {best['makespan_s']:8.2f}s "
                f"{best['latency_mean_s']:8.2f}s {best['latency_p50_s']:6.2f}s {best['latency_p90_s']:6.2f}s "
                f"{best['decode_forwards']:6.0f}"
            )
        c, w = summary[load]["continuous"], summary[load]["waves"]
        summary[load]["ratio_continuous_over_waves"] = {
            "tokens_per_s": c["tokens_per_s"] / w["tokens_per_s"],
            "latency_mean_s": c["latency_mean_s"] / w["latency_mean_s"],
            "latency_p90_s": c["latency_p90_s"] / w["latency_p90_s"],
        }
        r = summary[load]["ratio_continuous_over_waves"]
        print(
            f"{load:7} continuous/waves: tokens/s x{r['tokens_per_s']:.2f}, mean latency x{r['latency_mean_s']:.2f}, "
            f"p90 latency x{r['latency_p90_s']:.2f}"
        )
    out = {"args": vars(args), "summary": summary, "runs": rows}
    write_json("sampler_batching", out, indent=1)
    plot(summary, RESULTS / "sampler_batching.png")


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()

    loads = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, label in (
        (axes[0], "tokens_per_s", "output tokens/s"),
        (axes[1], "latency_mean_s", "mean latency (s)"),
    ):
        for j, name in enumerate(("waves", "continuous")):
            ax.bar(
                [i + 0.38 * j for i in range(len(loads))],
                [summary[lo][name][key] for lo in loads],
                0.38,
                label=name,
            )
        ax.set_xticks([i + 0.19 for i in range(len(loads))], loads)
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle("LocalSampler on tiny-moe (CPU, contended): continuous batching vs waves")
    save_figure(fig, path, dpi=100)


if __name__ == "__main__":
    main()
