"""A stopped run exits: SIGTERM to a ``labrl train`` whose process pool is busy with work that never
returns. Before the fix the summary was written at once and the process then hung for ever at
interpreter exit (``concurrent.futures.process._python_exit`` joining the pool's manager thread)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

DRIVER = str(Path(__file__).parent / "pool_train_driver.py")
TINY = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "ffn_hidden_size": 64,
        "moe_ffn_hidden_size": 32, "num_experts": 2, "moe_router_topk": 2, "max_sequence_length": 64}  # fmt: skip
EXIT_BOUND_S = 20.0  # generous: the fix exits in about a second; before it, never

pytestmark = pytest.mark.slow


def write_config(path: Path, run_dir: Path) -> Path:
    cfg = {
        "env": {"id": "test/pool-hang-v0"},
        "model": {"preset": "tiny-moe", "overrides": TINY},
        "sampler": {"max_new_tokens": 2, "local": {"max_batch_size": 16}},
        "learner": {"micro_batch_size": 8, "router_replay": False},
        "pipeline": {
            "batch_groups": 2,
            "group_size": 2,
            "total_steps": 1_000_000,
            "eval_every": 0,
            "dynamic_sampling": False,
            # every group fails (its scoring never returns): keep the stall guard from ending the run
            # before the test signals it
            "max_oversample_factor": 1_000_000.0,
            "progress": False,
        },
        "sft": {"enabled": False},
        "run_dir": str(run_dir),
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def error_rows(run_dir: Path) -> int:
    path = run_dir / "errors.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def living_members(group: int) -> list[int]:
    """Processes of process group ``group`` that have not exited (zombies left to an init that never
    reaps, as in some containers, count as exited)."""
    living = []
    for entry in Path("/proc").iterdir():
        try:
            # /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces, so split after ")"
            state, _ppid, pgrp = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):  # not a process, or it ended meanwhile
            continue
        if int(pgrp) == group and state != "Z":
            living.append(int(entry.name))
    return living


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_sigterm_with_a_busy_pool_exits_within_seconds_of_the_summary(tmp_path):
    run = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", run)
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    with out_path.open("w") as out_file, err_path.open("w") as err_file:
        proc = subprocess.Popen(  # its own session: the test can end the forkserver and workers too
            [sys.executable, DRIVER, "train", str(config)],
            stdout=out_file,
            stderr=err_file,
            env={**os.environ, "LABRL_CPU_WORKERS": "1"},
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        while error_rows(run) < 1 and proc.poll() is None:  # an episode timed out: the worker is stuck
            assert time.monotonic() < deadline, "no episode reached the pool"
            time.sleep(0.2)
        # the run, the forkserver, the worker (and a resource tracker): on a loaded machine the episodes
        # can time out while the forkserver is still starting the worker, so wait for it
        while len(living_members(proc.pid)) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, "the pool's worker never started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # to the run only, as `kill PID` does: the pool is left busy
        summary = run / "summary.json"
        while not summary.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "no summary after SIGTERM"
            time.sleep(0.05)
        try:
            proc.wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"train still running {EXIT_BOUND_S:g} s after writing {summary}")
        time.sleep(1.0)  # the resource tracker ends when it reads the run's exit
        assert living_members(proc.pid) == []  # no worker or forkserver left behind
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group may have ended already
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    out, err = out_path.read_text(), err_path.read_text()
    assert proc.returncode == 143, (out, err)
    assert json.loads(summary.read_text())["stopped_by"] == "SIGTERM"
    assert "Traceback" not in out + err
