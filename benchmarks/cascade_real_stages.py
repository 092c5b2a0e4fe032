"""Benchmark: cost and latency of the two stages of ``materials/cascade-chgnet-pyscf-v0``.

Each stage's calculation is dispatched as the env's calculator dispatches it
(``lab_adapters/simulator.py``): CHGNet through the shared process pool (``run_cpu``), PySCF in a
fresh killable subprocess (``run_killable``), one call at a time. Per call it records the wall
time seen by the caller (the stage's latency: dispatch, model or library import on a cold
process, the calculation) and the CPU-seconds of the calculation inside the worker (the stage's
cost in ``cpu_s``). Candidates: each molecule of the catalogue at ``d_exp * f`` for ``calls /
len(molecules)`` factors ``f`` spread over [0.9, 1.3] (both calculators' optima lie inside). Prints the medians and writes
``benchmarks/results/cascade_real_stages.json``.

    python benchmarks/cascade_real_stages.py [--calls 20]

The machine's load changes wall times (not CPU-seconds): run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from _results import write_json  # beside this script

from labrl.envs.sim.cascade_references import MOLECULES, energy_request
from labrl.lab_adapters.calculators import execute_calculation
from labrl.offload import run_cpu, run_killable

STAGES = {"chgnet": "chgnet", "dft": "pyscf"}  # stage -> calculator backend, as in the env


def timed_calculation(request: dict[str, Any]) -> float:
    """CPU-seconds (this process, all threads) of one calculation, run where the caller sends it."""
    started = time.process_time()
    execute_calculation(request)
    return time.process_time() - started


async def measure(backend: str, requests: list[dict[str, Any]]) -> dict[str, Any]:
    walls, cpus = [], []
    for request in requests:
        started = time.perf_counter()
        if backend == "pyscf":
            cpu = await run_killable(timed_calculation, request, timeout=600.0)
        else:
            cpu = await run_cpu(timed_calculation, request)
        walls.append(time.perf_counter() - started)
        cpus.append(cpu)
    return {
        "calls": len(requests),
        "median_wall_s": statistics.median(walls),
        "median_cpu_s": statistics.median(cpus),
        "first_wall_s": walls[0],
        "wall_s": walls,
        "cpu_s": cpus,
    }


def candidates(calls: int) -> list[tuple[str, float]]:
    per_molecule = -(-calls // len(MOLECULES))  # at least ``calls`` in all
    factors = [0.9 + 0.4 * i / max(per_molecule - 1, 1) for i in range(per_molecule)]
    return [(m, MOLECULES[m].d_exp * f) for m in MOLECULES for f in factors]


async def main_async(calls: int) -> dict[str, Any]:
    points = candidates(calls)
    results = {}
    for stage, backend in STAGES.items():
        requests = [energy_request(backend, m, d) for m, d in points]
        results[stage] = {"backend": backend, **await measure(backend, requests)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="calls per stage")
    args = parser.parse_args()
    results = asyncio.run(main_async(args.calls))
    print(
        f"{'stage':8s} {'backend':8s} {'calls':>5s} {'median wall s':>14s} {'median cpu_s':>13s} {'first wall s':>13s}"
    )
    for stage, r in results.items():
        print(
            f"{stage:8s} {r['backend']:8s} {r['calls']:5d} {r['median_wall_s']:14.3f} "
            f"{r['median_cpu_s']:13.3f} {r['first_wall_s']:13.3f}"
        )
    ratio = results["dft"]["median_cpu_s"] / results["chgnet"]["median_cpu_s"]
    print(f"DFT / CHGNet cost per call: {ratio:.0f}x")
    write_json("cascade_real_stages", {"stages": results, "dft_over_chgnet_cpu": ratio})


if __name__ == "__main__":
    main()
