"""Kills as a user does them: SIGKILL, Ctrl-C (SIGINT) and SIGTERM sent to a ``labrl train`` process.

- Ctrl-C during the warm start stops it promptly: exit 130, one line, no traceback;
- SIGKILL, then a resume, then Ctrl-C in RL, then a resume: every step is listed once in
  metrics.jsonl / trained.jsonl / eval.jsonl, no group is trained twice, the wall clock of the
  metrics never goes back, and the Ctrl-C exit is 130 with one line naming the checkpoint.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

DRIVER = str(Path(__file__).parent / "train_driver.py")
TINY = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "ffn_hidden_size": 64,
        "moe_ffn_hidden_size": 32, "num_experts": 2, "moe_router_topk": 2, "max_sequence_length": 32}  # fmt: skip

pytestmark = pytest.mark.slow


def write_config(path: Path, run_dir: Path, **sections) -> Path:
    cfg = {
        "env": {"id": "test/letter-v0"},
        "model": {"preset": "tiny-moe", "overrides": TINY},
        "sampler": {"max_new_tokens": 2, "local": {"max_batch_size": 16}},
        "learner": {"micro_batch_size": 8, "router_replay": False},
        "objective": {"advantages": "whiten"},
        "pipeline": {
            "batch_groups": 2,
            "group_size": 2,
            "max_staleness": 1,
            "total_steps": 1_000_000,
            "eval_every": 2,
            "eval_size": 4,
            "dynamic_sampling": False,
            "progress": False,
            "checkpoint_every": 4,
            "checkpoint_every_s": 0,
        },
        "sft": {"enabled": True, "steps": 2, "batch_size": 4, "num_prompts": 4},
        "run_dir": str(run_dir),
    }
    for key, value in sections.items():
        cfg[key] = cfg.get(key, {}) | value
    path.write_text(yaml.safe_dump(cfg))
    return path


def start(config: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, DRIVER, "train", str(config), *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            pass
    return out


def wait_for(proc: subprocess.Popen, path: Path, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(lines(path)) < n:
        if proc.poll() is not None:
            raise AssertionError(f"train exited early (rc {proc.returncode}): {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{path} did not reach {n} lines in {timeout} s")
        time.sleep(0.2)


def test_ctrl_c_during_the_warm_start_exits_130_with_one_line(tmp_path):
    run = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", run, sft={"steps": 100_000, "batch_size": 2})
    proc = start(config)
    wait_for(proc, run / "sft.jsonl", 1)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert time.monotonic() - sent < 60  # promptly: within a warm-start step, not the 100,000
    assert "Traceback" not in out + err
    assert out.strip().splitlines() == [
        f"labrl: stopped by SIGINT at step 0: nothing saved (stopped during the warm start); "
        f"run the same command to start again ({run})"
    ]
    assert not (run / "checkpoints").exists()
    assert len(lines(run / "sft.jsonl")) < 100_000


def test_sigkill_then_ctrl_c_then_resume_lists_every_step_once(tmp_path):
    from labrl.harness.pipeline.checkpoint import latest_checkpoint

    run = tmp_path / "run"
    # env latency 0.1 s: steps slow enough for the kill to land between two checkpoints
    config = write_config(tmp_path / "c.yaml", run, env={"options": {"latency_s": 0.1}})
    first = start(config)
    wait_for(first, run / "metrics.jsonl", 6)  # checkpoints at 0 (after the warm start) and 4
    while True:  # freeze it where steps after the last checkpoint are logged, then SIGKILL: they are lost
        first.send_signal(signal.SIGSTOP)
        killed_at = max(r["step"] for r in lines(run / "metrics.jsonl"))
        ckpt = latest_checkpoint(run)
        assert ckpt is not None
        if int(ckpt.name.removeprefix("step_")) < killed_at:
            break
        first.send_signal(signal.SIGCONT)
        wait_for(first, run / "metrics.jsonl", killed_at + 1)
    first.kill()
    first.wait()
    assert int(ckpt.name.removeprefix("step_")) % 4 == 0

    second = start(config)  # resumes from the checkpoint; Ctrl-C once past the steps the kill lost
    wait_for(second, run / "metrics.jsonl", killed_at + 2)
    second.send_signal(signal.SIGINT)
    out, err = second.communicate(timeout=180)
    assert second.returncode == 130, (out, err)
    stopped = latest_checkpoint(run)
    assert stopped is not None
    step = int(stopped.name.removeprefix("step_"))
    assert out.strip().splitlines()[-1] == (
        f"labrl: stopped by SIGINT at step {step}: checkpoint {stopped} saved; "
        f"run the same command to resume ({run})"
    )
    assert "Traceback" not in out + err and "resumed from" in out

    third = subprocess.run(
        [sys.executable, DRIVER, "train", str(config), f"pipeline.total_steps={step + 2}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert third.returncode == 0, third.stderr
    metrics = lines(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, step + 3))
    trained = lines(run / "trained.jsonl")
    assert [r["step"] for r in trained] == list(range(1, step + 3))
    groups = [g for r in trained for g in r["groups"]]
    assert len(groups) == len(set(groups))
    evals = [r["step"] for r in lines(run / "eval.jsonl")]
    assert evals == sorted(set(evals)) and evals[0] == 0 and evals[-1] == step + 2
    times = [r["time_s"] for r in metrics]
    assert times == sorted(times)  # wall clock carried over the resumes
    assert len(lines(run / "sft.jsonl")) == 2  # the warm start ran once
