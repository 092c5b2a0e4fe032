"""``benchmarks/serve.py`` at tiny scale against a real OpenEnv server: it counts what it asked for."""

from __future__ import annotations

import pytest

pytest.importorskip("openenv")

from serve_bench_checks import check_small_run


async def test_the_serve_benchmark_counts_every_step_in_process_and_over_openenv():
    await check_small_run("openenv")
