"""How much does the Env framework cost per step, at up to 10,000 concurrent episodes?

A synthetic env sleeps for each step (constant latency, or lognormal with
p99/p50 = 20 and the same mean). Episodes run through the whole framework:
``make`` (BudgetedEnv: deadline, retries, outcome classification),
``run_episode`` (policy call, action parsing, transcript) and pydantic records.

Ideal throughput = concurrency / mean step latency (what a zero-cost framework
would achieve); we report achieved / ideal, the framework overhead per step
(wall time of a step minus the latency the env slept), and peak RSS. Each
concurrency level runs in a fresh subprocess so RSS is its own.

    python benchmarks/env_throughput.py [--levels 1,10,100,1000,10000] [--seconds 12]

Writes benchmarks/results/env_throughput.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import random
import resource
import statistics
import time
from typing import Any

from _results import RESULTS, pyplot, save_figure, write_json  # beside this script

from labrl.envs import (
    Action,
    Env,
    EnvSpec,
    Message,
    Observation,
    StepResult,
    Task,
    make,
    register,
    run_episode,
)
from labrl.envs.types import Budgets
from labrl.runtime import tune_gc_for_many_episodes

P99_OVER_P50 = 20.0
Z99 = 2.3263478740408408  # standard normal 99th percentile
STEPS_PER_EPISODE = 4


def lognormal_params(mean: float) -> tuple[float, float]:
    """(mu, sigma) of a lognormal with the given mean and p99/p50 = 20: sigma = ln 20 / z99, mean = e^(mu + sigma^2/2)."""
    sigma = math.log(P99_OVER_P50) / Z99
    return math.log(mean) - sigma**2 / 2, sigma


class SleepEnv(Env):
    """Multi-turn env whose every step sleeps a drawn latency and records it."""

    def __init__(self, latency: str = "constant", mean_s: float = 1.0) -> None:
        self.spec = EnvSpec(
            id="bench/sleep-v0", budgets=Budgets(max_turns=STEPS_PER_EPISODE, step_timeout_s=600)
        )
        self.latency, self.mean_s = latency, mean_s
        self.mu, self.sigma = lognormal_params(mean_s) if latency == "lognormal" else (0.0, 0.0)
        self.rng = random.Random() if latency == "lognormal" else None
        self.slept: list[float] = []
        self.finished_at: list[float] = []  # loop time at which each step's latency ended

    def make_task(self, split: Any, seed: int) -> Task:
        return Task(env_id=self.spec.id, split=split, seed=seed, task_id=f"{split}-{seed}")

    async def reset(self, task: Task) -> Observation:
        if self.rng is not None:
            self.rng.seed(task.seed)
        self.turn = 0
        return Observation(messages=(Message(role="user", content="go"),))

    async def step(self, action: Action) -> StepResult:
        delay = self.mean_s if self.latency == "constant" else self.rng.lognormvariate(self.mu, self.sigma)
        self.slept.append(delay)
        await asyncio.sleep(delay)
        self.finished_at.append(asyncio.get_running_loop().time())
        self.turn += 1
        done = self.turn >= STEPS_PER_EPISODE
        return StepResult(
            observation=Observation(messages=(Message(role="user", content="ok"),)),
            reward=1.0 if done else None,
            done=done,
        )


async def _drive(concurrency: int, latency: str, seconds: float, warmup: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    stop_at = start + warmup + seconds
    counted_steps = 0
    slept_in_window = 0.0
    overheads: list[float] = []

    async def policy(messages: Any, tools: Any) -> str:
        return "next"

    async def worker(index: int) -> None:
        nonlocal counted_steps, slept_in_window
        seed = index * 1_000_000
        # stagger starts over one mean latency so the load is steady, not a thundering herd
        await asyncio.sleep(random.Random(index).random())
        while loop.time() < stop_at:
            env = make("bench/sleep-v0", latency=latency)
            episode = await run_episode(env, env.make_task("train", seed), policy)
            seed += 1
            inner = env.unwrapped
            for turn, slept, finished in zip(episode.turns, inner.slept, inner.finished_at, strict=True):
                if start + warmup <= finished <= stop_at:
                    counted_steps += 1
                    slept_in_window += slept
                    if len(overheads) < 200_000:
                        overheads.append(turn.env_s + turn.policy_s - slept)

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return {"steps": counted_steps, "slept": slept_in_window, "overheads": overheads}


def run_level(
    concurrency: int, latency: str, seconds: float, warmup: float, gc_mode: str = "tuned"
) -> dict[str, Any]:
    register("bench/sleep-v0", entry_point=SleepEnv)
    if gc_mode == "tuned":  # what the labrl CLI does (labrl.runtime)
        tune_gc_for_many_episodes()
    t0 = time.perf_counter()
    raw = asyncio.run(_drive(concurrency, latency, seconds, warmup))
    wall = time.perf_counter() - t0
    mean_latency = raw["slept"] / max(raw["steps"], 1)
    # steps whose latency ended inside the measurement window, over the window length
    achieved = raw["steps"] / seconds
    # ideal from the configured mean (1 s): the sampled mean of a heavy tail over a short window is biased low
    ideal = concurrency / 1.0
    overheads = sorted(raw["overheads"]) or [float("nan")]
    return {
        "concurrency": concurrency,
        "latency": latency,
        "gc": gc_mode,
        "mean_latency_s": mean_latency,
        "steps_per_s": achieved,
        "ideal_steps_per_s": ideal,
        "fraction_of_ideal": achieved / ideal,
        "overhead_p50_ms": 1e3 * overheads[len(overheads) // 2],
        "overhead_p99_ms": 1e3 * overheads[min(len(overheads) - 1, int(0.99 * len(overheads)))],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "wall_s": wall,
    }


def _run_in_child(args: tuple[int, str, float, float, str]) -> dict[str, Any]:
    return run_level(*args)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", default="1,10,100,1000,10000")
    parser.add_argument("--latencies", default="constant,lognormal")
    parser.add_argument("--seconds", type=float, default=12.0, help="measurement window per level")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument(
        "--gc",
        default="tuned,default",
        help="GC settings to compare: tuned (labrl.runtime, as the CLI runs) and/or default",
    )
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    rows = []
    ctx = mp.get_context("spawn")
    for gc_mode in args.gc.split(","):
        for latency in args.latencies.split(","):
            for level in levels:
                if gc_mode == "default" and level < max(levels):
                    continue  # the collector only matters at scale: compare at the largest level
                with ctx.Pool(1) as pool:
                    row = pool.apply(_run_in_child, ((level, latency, args.seconds, args.warmup, gc_mode),))
                rows.append(row)
                print(
                    f"gc {gc_mode:>7} {latency:>9} {level:>6} episodes: {row['steps_per_s']:9.1f} steps/s of ideal {row['ideal_steps_per_s']:9.1f}"
                    f" ({100 * row['fraction_of_ideal']:5.1f}%), overhead p50 {row['overhead_p50_ms']:6.2f} ms"
                    f" p99 {row['overhead_p99_ms']:7.2f} ms, peak RSS {row['peak_rss_mib']:6.0f} MiB",
                    flush=True,
                )
    write_json("env_throughput", rows)
    print(
        "\n| latency | concurrency | steps/s | ideal | % of ideal | overhead p50 (ms) | overhead p99 (ms) | peak RSS (MiB) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['gc']} | {r['latency']} | {r['concurrency']} | {r['steps_per_s']:.1f} | {r['ideal_steps_per_s']:.1f} | "
            f"{100 * r['fraction_of_ideal']:.1f} | {r['overhead_p50_ms']:.2f} | {r['overhead_p99_ms']:.2f} | {r['peak_rss_mib']:.0f} |"
        )
    _plot(rows)
    for gc_mode in args.gc.split(","):
        at_max = [
            r["fraction_of_ideal"] for r in rows if r["concurrency"] == max(levels) and r["gc"] == gc_mode
        ]
        print(
            f"gc {gc_mode}: mean fraction of ideal at {max(levels)} episodes: {100 * statistics.fmean(at_max):.1f}%"
        )


def _plot(rows: list[dict[str, Any]]) -> None:
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for latency in sorted({r["latency"] for r in rows}):
        sel = [r for r in rows if r["latency"] == latency and r["gc"] == "tuned"]
        for r in (r for r in rows if r["latency"] == latency and r["gc"] == "default"):
            ax1.scatter([r["concurrency"]], [100 * r["fraction_of_ideal"]], marker="x", color="red", zorder=3)
            ax1.annotate(
                f"default GC ({latency})", (r["concurrency"], 100 * r["fraction_of_ideal"]), fontsize=7
            )
        xs = [r["concurrency"] for r in sel]
        ax1.plot(xs, [100 * r["fraction_of_ideal"] for r in sel], marker="o", label=latency)
        ax2.plot(xs, [r["overhead_p99_ms"] for r in sel], marker="o", label=f"{latency} p99")
        ax2.plot(xs, [r["overhead_p50_ms"] for r in sel], marker="x", linestyle="--", label=f"{latency} p50")
    ax1.set(
        xscale="log",
        xlabel="concurrent episodes",
        ylabel="% of ideal steps/s",
        ylim=(0, 105),
        title="throughput",
    )
    ax1.axhline(90, color="grey", linestyle=":")
    ax2.set(
        xscale="log",
        yscale="log",
        xlabel="concurrent episodes",
        ylabel="overhead per step (ms)",
        title="framework overhead",
    )
    ax1.legend()
    ax2.legend()
    save_figure(fig, RESULTS / "env_throughput.png")


if __name__ == "__main__":
    main()
