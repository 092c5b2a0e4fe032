"""What both protocols' tests of ``benchmarks/serve.py`` check: a small run measured in full.

Two loads (2 sessions x 3 episodes of a 0 s env; 2 x 1 of a 50 ms env) and 3 idle sessions, in-process
and over the protocol against a real server process: every requested episode and step is counted,
nothing failed, the 50 ms steps took at least 50 ms, CPU and RSS were read, and the goals
that need the full run's loads say they were not measured.
"""

from __future__ import annotations

from interop_servers import serve_benchmark

WAIT_S = 0.05


async def check_small_run(protocol: str) -> None:
    bench = serve_benchmark()
    loads = [
        bench.Load(sessions=2, episodes=3, wait_s=0.0),
        bench.Load(sessions=2, episodes=1, wait_s=WAIT_S),
    ]
    result = await bench.run(protocol, loads, idle_sessions=3)

    assert result["protocol"] == protocol
    assert [(r["sessions"], r["episodes"], r["wait_s"]) for r in result["rows"]] == [
        (2, 3, 0.0),
        (2, 1, WAIT_S),
    ]
    for row, load in zip(result["rows"], loads, strict=True):
        assert row["steps_requested"] == load.steps == load.sessions * load.episodes * 2
        for path in (bench.IN_PROCESS, protocol):
            measured = row[path]
            assert measured["errors"] == 0, measured["error_kinds"]
            assert measured["episodes"] == load.sessions * load.episodes
            assert measured["steps"] == load.steps
            assert 0 < measured["step_p50_ms"] <= measured["step_p99_ms"]
            assert measured["episodes_per_s"] > 0 and measured["cpu_s"] >= 0
        assert row[protocol]["client_cpu_s"] >= 0  # over a protocol, the client's CPU is counted apart
        assert row["throughput_ratio"] == round(
            row[protocol]["episodes_per_s"] / row[bench.IN_PROCESS]["episodes_per_s"], 4
        )
    waited = result["rows"][1]
    assert waited[bench.IN_PROCESS]["step_p50_ms"] >= 1e3 * WAIT_S
    assert waited[protocol]["step_p50_ms"] >= 1e3 * WAIT_S

    for path in (bench.IN_PROCESS, protocol):
        idle = result["idle"][path]
        assert idle["held"] == idle["sessions"] == 3 and idle["errors"] == 0, idle
        assert idle["rss_held_mib"] > 0 and idle["rss_before_mib"] > 0

    goals = bench.goals(result)
    assert goals["throughput_ratio_100x1s"]["met"] is None  # no load of 100 sessions of the 1 s env
    assert goals["sessions_held_1000"]["met"] is None  # 3 held, not 1,000
    assert goals["kib_per_idle_session"]["value"] == result["idle"][protocol]["kib_per_idle_session"]
