"""Benchmark: 1,000 concurrent lab jobs through RestLabAdapter + journal against the mock lab.

Two runs in the same process, same machine, same moment (CPU is shared, so
compare the ratio, not the absolute numbers):

- ``baseline``: no faults;
- ``faults``: 10 % 5xx, 5 % hangs (15 s, past the 10 s client timeout), 2 % duplicate
  deliveries and one server restart after 300 deliveries.

Each prints jobs/s, p50/p99 end-to-end latency (submit -> result delivered),
client retries, and lost / duplicated counts (both must be 0). Writes
``benchmarks/results/lab_adapter.json`` and ``lab_adapter.png``.

    python benchmarks/lab_adapter.py [--jobs 1000] [--latency 2.0]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from _proc import cpu_seconds  # beside this script
from _results import save_histograms, write_json

from labrl.lab_adapters.job_journal import Journal
from labrl.lab_adapters.journaled_lab import JournaledLab, JournaledLabConfig
from labrl.lab_adapters.mock.process import MockLabProcess
from labrl.lab_adapters.mock.server import FaultConfig, MockLabConfig
from labrl.lab_adapters.rest import RestLabAdapter, RestLabConfig

TOKEN = "bench-token"


def _server_cpu_s(lab: MockLabProcess) -> float:
    """CPU seconds (user + system) the mock server process has used so far."""
    assert lab.process is not None
    return cpu_seconds(lab.process.pid)


async def run(
    name: str,
    jobs: int,
    latency: float,
    faults: FaultConfig,
    restart_after: int | None,
    max_concurrency: int = 16,
) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"lab-bench-{name}-"))
    lab = MockLabProcess(
        MockLabConfig(
            state_dir=workdir / "lab", port=0, latency_median_s=latency, latency_sigma=0.5, faults=faults
        ),
        token=TOKEN,
    ).start()
    adapter = RestLabAdapter(
        RestLabConfig(
            base_url=lab.url,
            call_timeout_s=2.0,
            long_poll_s=2.0,
            backoff_base_s=0.05,
            backoff_max_s=1.0,
            rate_limit_per_s=None,
            max_concurrency=max_concurrency,
            breaker_threshold=50,
            breaker_reset_s=0.5,
            seed=0,
        )
    )
    journal = Journal(workdir / "journal.sqlite")
    delivered: collections.Counter[str] = collections.Counter()
    client = JournaledLab(
        adapter,
        journal,
        JournaledLabConfig(feed_wait_s=1.0, fallback_poll_s=10.0),
        on_result=lambda key, status: delivered.update([key]),
    )
    latencies: list[float] = []

    async def one(i: int) -> bool:
        t0 = time.perf_counter()
        outcome = await client.run({"kind": "echo", "payload": {"i": i}}, f"bench-{i}")
        latencies.append(time.perf_counter() - t0)
        return outcome.status.result is not None and outcome.status.result["echo"] == {"i": i}

    server_cpu = 0.0  # CPU of server processes that were restarted away

    async def restarter() -> None:
        nonlocal server_cpu
        if restart_after is None:
            return
        while client.stats["delivered"] < restart_after:
            await asyncio.sleep(0.05)
        server_cpu += _server_cpu_s(lab)
        await asyncio.to_thread(lab.restart)

    cpu0 = time.process_time()
    t0 = time.perf_counter()
    background = asyncio.ensure_future(restarter())
    correct = await asyncio.gather(*(one(i) for i in range(jobs)))
    wall = time.perf_counter() - t0
    client_cpu = time.process_time() - cpu0
    await background
    server_cpu += _server_cpu_s(lab)
    stats = lab.stats()
    await client.aclose()
    await adapter.aclose()
    await journal.close()
    lab.stop()
    lat = np.array(latencies)
    return {
        "name": name,
        "jobs": jobs,
        "median_lab_latency_s": latency,
        "wall_s": round(wall, 2),
        "jobs_per_s": round(jobs / wall, 1),
        "p50_s": round(float(np.percentile(lat, 50)), 3),
        "p99_s": round(float(np.percentile(lat, 99)), 3),
        "max_concurrency": max_concurrency,
        "client_cpu_ms_per_job": round(1000 * client_cpu / jobs, 2),
        "server_cpu_ms_per_job": round(1000 * server_cpu / jobs, 2),
        "http_calls": adapter.stats["calls"],
        "client_stats": dict(client.stats),
        "retries": adapter.stats["retries"],
        "retry_reasons": {k: v for k, v in adapter.stats.items() if k.startswith("retry_")},
        "lost": jobs - len(delivered),
        "duplicated": sum(v - 1 for v in delivered.values()),
        "wrong_result": correct.count(False),
        "max_runs_per_job": stats["max_runs_per_job"],
        "lab_counters": stats["counters"],
        "restarted": restart_after is not None,
        "latencies": sorted(round(x, 4) for x in latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--latency", type=float, default=2.0)
    args = parser.parse_args()
    os.environ["LABRL_LAB_API_KEY"] = TOKEN
    logging.basicConfig(
        level=logging.ERROR
    )  # "gave up, retrying at the driver level" warnings are expected here
    faults = FaultConfig(error_rate=0.10, hang_rate=0.05, hang_s=15.0, duplicate_rate=0.02)
    load_before = os.getloadavg()
    rows = [
        asyncio.run(run("baseline", args.jobs, args.latency, FaultConfig(), None)),
        asyncio.run(run("faults", args.jobs, args.latency, faults, restart_after=min(300, args.jobs // 3))),
    ]
    header = f"{'run':10} {'jobs/s':>8} {'p50 s':>7} {'p99 s':>7} {'calls':>6} {'retries':>8} {'lost':>5} {'dup':>4} {'max runs':>8}"
    print(header)
    for r in rows:
        print(
            f"{r['name']:10} {r['jobs_per_s']:8.1f} {r['p50_s']:7.2f} {r['p99_s']:7.2f} {r['http_calls']:6d} "
            f"{r['retries']:8d} {r['lost']:5d} {r['duplicated']:4d} {r['max_runs_per_job']:8d}"
        )
    load_after = os.getloadavg()
    for r in rows:
        r["loadavg_1_5_15_before_after"] = [list(load_before), list(load_after)]
    print(f"machine load (1/5/15 min) before {load_before}, after {load_after}; {os.cpu_count()} CPUs")
    print(
        "CPU per job (ms, client / server): "
        + ", ".join(f"{r['name']} {r['client_cpu_ms_per_job']} / {r['server_cpu_ms_per_job']}" for r in rows)
    )
    base, fault = rows
    print(
        f"faults/baseline: throughput x{fault['jobs_per_s'] / base['jobs_per_s']:.2f}, "
        f"p99 x{fault['p99_s'] / base['p99_s']:.2f}"
    )
    write_json("lab_adapter", rows, indent=1)
    save_histograms(
        "lab_adapter",
        {f"{r['name']} (p99 {r['p99_s']:.1f} s)": r["latencies"] for r in rows},
        xlabel="end-to-end latency per job (s)",
        ylabel="jobs",
        title=f"{args.jobs} concurrent lab jobs, median lab latency {args.latency:g} s",
        bins=60,
        histtype="step",
    )


if __name__ == "__main__":
    main()
