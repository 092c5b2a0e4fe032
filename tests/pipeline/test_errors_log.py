"""errors.jsonl: each distinct error once in full, repeats counted, bounded, and consistent across a resume."""

from __future__ import annotations

import json

from labrl.harness.pipeline import errors_log
from labrl.harness.pipeline.errors_log import ErrorLog, distinct_errors, error_id, normalise_message
from labrl.harness.pipeline.resume import truncate_run_logs
from labrl.harness.types import Trajectory

TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/x/envs/lab/env.py", line 40, in step\n    await self.lab.submit(job)\n'
    '  File "/x/lab_adapters/rest.py", line {line}, in submit\n    raise EnvError(...)\n'
    "EnvError: lab returned 503 for job {job}\n"
)


def failed(task: int, *, outcome: str = "env_error", line: int = 88) -> Trajectory:
    message = f"EnvError: lab returned 503 for job {task:08x}-{task}" if outcome == "env_error" else None
    return Trajectory(
        env_id="lab/synthesis-v0", task_id=f"lab/synthesis-v0:train:{task}", group_id="g",
        tokens_T=[1], loss_mask_T=[0], logprobs_T=[0.0], versions_T=[-1], reward=None, outcome=outcome,
        finish_reason="stop", num_turns=1,
        info={"error": message, "traceback": TRACEBACK.format(line=line, job=task)} if message else {},
    )  # fmt: skip


def lines(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "errors.jsonl").read_text().splitlines()]


def test_numbers_and_ids_are_normalised_but_the_origin_tells_errors_apart():
    assert normalise_message("job 3fa2b9c0d1-17 took 12.5 s at 0x7f00") == "job #-# took # s at #"
    a, b, elsewhere = (failed(1), failed(2), failed(3, line=90))
    record = {"kind": "episode", "phase": "train"}

    def key(t: Trajectory) -> str:
        return error_id(
            record | {"outcome": t.outcome, "message": t.info["error"], "traceback": t.info["traceback"]}
        )

    assert key(a) == key(b) != key(elsewhere)


def test_thousands_of_identical_failures_keep_a_bounded_file_with_exact_counts(tmp_path):
    log = ErrorLog(tmp_path)
    sent = {"env_error": 0, "timeout": 0}
    for step in range(5):
        for task in range(2000):
            outcome = "timeout" if task % 4 == 0 else "env_error"
            sent[outcome] += 1
            log.episodes([failed(step * 2000 + task, outcome=outcome)], step=step, phase="train")
    log.episodes([failed(7)], step=5, phase="eval")  # the same fault in another phase is another error
    log.close()
    rows = lines(tmp_path)
    # 3 distinct errors in full, then the repeats: one row per step (all counted within 30 s)
    assert [r["kind"] for r in rows] == ["episode", "episode", "episode"] + ["repeats"] * 5
    assert (tmp_path / "errors.jsonl").stat().st_size < 5_000  # 10,001 rows of ~700 bytes before
    counts = {(e["phase"], e["outcome"]): e["count"] for e in distinct_errors(tmp_path)}
    assert counts == {("train", "timeout"): 2500, ("train", "env_error"): 7500, ("eval", "env_error"): 1}
    first = next(e for e in distinct_errors(tmp_path) if e["outcome"] == "env_error")
    assert first["task_id"] == "lab/synthesis-v0:train:1" and "rest.py" in first["traceback"]
    assert [r["counts"] for r in rows[3:]] == [
        {first["error_id"]: 1499, rows[0]["error_id"]: 499},
        *[{first["error_id"]: 1500, rows[0]["error_id"]: 500}] * 4,
    ]


def test_repeats_are_written_every_30_s_so_a_kill_loses_at_most_that(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(errors_log.time, "monotonic", lambda: clock[0])
    log = ErrorLog(tmp_path)
    for task in range(10):
        log.episodes([failed(task)], step=0, phase="train")
        clock[0] += 5.0
    # counted at 1005 (first repeat) .. 1045: the repeat at 1035 is 30 s after the first, the row is written
    assert [r["kind"] for r in lines(tmp_path)] == ["episode", "repeats"]
    assert lines(tmp_path)[1]["counts"] == {lines(tmp_path)[0]["error_id"]: 7}
    log.close()
    assert sum(e["count"] for e in distinct_errors(tmp_path)) == 10


def test_a_resumed_run_counts_known_errors_as_repeats_and_drops_counts_after_the_checkpoint(tmp_path):
    log = ErrorLog(tmp_path)
    for step in range(5):
        log.episodes([failed(step * 10 + i) for i in range(10)], step=step, phase="train")
    log.close()
    truncate_run_logs(tmp_path, 2)  # resumed from the checkpoint of step 2: steps 3 and 4 are replayed
    resumed = ErrorLog(tmp_path)
    for step in (3, 4):
        resumed.episodes([failed(100 + step * 10 + i) for i in range(10)], step=step, phase="train")
    resumed.close()
    (error,) = distinct_errors(tmp_path)
    assert error["count"] == 50 and error["step"] == 0
    assert [r["kind"] for r in lines(tmp_path)].count("episode") == 1
