"""``benchmarks/serve.py`` outside the protocols' venvs: one line naming the extra; its /proc readers.

The measurement itself is tested against real servers in tests/interop/{openenv,ors}/test_serve_bench.py.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
from interop_servers import serve_benchmark


@pytest.mark.parametrize(("protocol", "package"), [("openenv", "openenv"), ("ors", "openreward")])
def test_the_benchmark_without_the_protocol_is_one_line_naming_the_extra(capsys, protocol, package):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"the {protocol} extra is installed")
    assert serve_benchmark().main(["--protocol", protocol]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"pip install 'labrl[{protocol}]'" in err


def test_cpu_seconds_counts_the_cpu_a_process_burned_and_rss_its_memory():
    serve_benchmark()  # puts benchmarks/ on sys.path
    from _proc import cpu_seconds, rss_bytes

    before, times_before = cpu_seconds(os.getpid()), os.times()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    burned = cpu_seconds(os.getpid()) - before
    by_os = (os.times().user + os.times().system) - (times_before.user + times_before.system)
    assert burned >= 0.25 and burned == pytest.approx(by_os, abs=0.03)
    held = b"\x01" * (64 * 2**20)  # written: every page is resident
    assert rss_bytes(os.getpid()) >= 64 * 2**20
    del held
