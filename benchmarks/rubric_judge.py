"""Rubric grading throughput against the mock judge on a real loopback socket.

Grades every shipped science-qa reference answer (33 tasks, ~6 llm items each)
in four configurations and reports responses per second and judge requests:

- batch="response" (one request per response) vs batch="item" (one per item);
- cold cache vs warm cache (the same responses graded again);
- max_concurrency 1 vs 8 (requests in flight per client).

The mock judge answers in well under a millisecond, so the numbers measure
labrl's own overhead (prompt building, HTTP, strict parsing, scoring), the
floor under any real judge's latency. CPU is shared with other work while
this runs: compare the ratios within one run, not absolute numbers across runs.

    .venv/bin/python benchmarks/rubric_judge.py   # table + benchmarks/results/rubric_judge.{json,png}
"""

from __future__ import annotations

import asyncio
import time

from _results import RESULTS, pyplot, save_figure, write_json  # beside this script

from labrl.envs.judged import load_tasks
from labrl.verifiers.rubric import JudgeCache, JudgeClient, JudgeConfig, RubricGrader
from labrl.verifiers.rubric.mock_judge import serve_in_thread


async def run(base_url: str, batch: str, concurrency: int, repeats: int = 3) -> dict[str, float]:
    tasks = load_tasks()
    config = JudgeConfig(base_url=base_url, model="mock", batch=batch, max_concurrency=concurrency)  # type: ignore[arg-type]
    async with JudgeClient(config, cache=JudgeCache()) as client:
        grader = RubricGrader([client])
        jobs = [
            (t.rubric, f"{t.reference_answer} (variant {r})", t.question)
            for r in range(repeats)
            for t in tasks
        ]
        t0 = time.perf_counter()
        cold = await asyncio.gather(*(grader.grade(*job) for job in jobs))
        cold_s = time.perf_counter() - t0
        requests = client.stats.requests
        t0 = time.perf_counter()
        await asyncio.gather(*(grader.grade(*job) for job in jobs))
        warm_s = time.perf_counter() - t0
    assert all(r.score == 1.0 for r in cold)
    return {
        "responses": len(jobs),
        "cold_responses_per_s": len(jobs) / cold_s,
        "warm_responses_per_s": len(jobs) / warm_s,
        "judge_requests": requests,
        "warm_requests": client.stats.requests - requests,
    }


def main() -> None:
    rows = []
    with serve_in_thread() as server:
        for batch in ("response", "item"):
            for concurrency in (1, 8):
                row = {"batch": batch, "max_concurrency": concurrency}
                row.update(asyncio.run(run(server.base_url, batch, concurrency)))
                rows.append(row)
    base = rows[0]["cold_responses_per_s"]
    print(
        f"{'batch':<9} {'conc':>4} {'resp':>5} {'requests':>8} {'cold resp/s':>11} {'x base':>7} {'warm resp/s':>11}"
    )
    for r in rows:
        print(
            f"{r['batch']:<9} {r['max_concurrency']:>4} {r['responses']:>5} {r['judge_requests']:>8} "
            f"{r['cold_responses_per_s']:>11.1f} {r['cold_responses_per_s'] / base:>7.2f} {r['warm_responses_per_s']:>11.1f}"
        )
    write_json("rubric_judge", rows)
    plt = pyplot()

    labels = [f"{r['batch']}\nconc {r['max_concurrency']}" for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["cold_responses_per_s"] for r in rows], 0.4, label="cold cache")
    ax.bar([i + 0.2 for i in x], [r["warm_responses_per_s"] for r in rows], 0.4, label="warm cache")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("responses graded / s")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("rubric grading vs mock judge (loopback)")
    save_figure(fig, RESULTS / "rubric_judge.png")


if __name__ == "__main__":
    main()
