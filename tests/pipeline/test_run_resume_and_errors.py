"""Run-level hardening, in process: periodic checkpoints, resume identity, logs once per step, errors visible.

Real components (tiny MoE, LocalSampler, MegatronLearner) on the fake letter env.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from labrl.errors import ConfigError, RunFailedError
from labrl.harness.config import apply_overrides, build_run_config
from labrl.harness.metrics import summary_line
from labrl.harness.pipeline.config import PipelineSection
from labrl.harness.pipeline.errors_log import distinct_errors
from labrl.harness.pipeline.resume import IDENTITY_KEYS, check_resume, truncate_run_logs
from labrl.harness.pipeline.runner import refuse_a_multi_process_launch, train
from labrl.harness.report import write_report

TINY = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "ffn_hidden_size": 64,
        "moe_ffn_hidden_size": 32, "num_experts": 2, "moe_router_topk": 2, "max_sequence_length": 32}  # fmt: skip


def config(env_id: str, run_dir: Path, *overrides: str, **pipeline):
    base = {
        "env": {"id": env_id},
        "model": {"preset": "tiny-moe", "overrides": TINY},
        "sampler": {"max_new_tokens": 2, "local": {"max_batch_size": 16}},
        "learner": {"micro_batch_size": 8, "router_replay": False},
        "pipeline": {
            "batch_groups": 2,
            "group_size": 2,
            "max_staleness": 1,
            "total_steps": 2,
            "eval_every": 1,
            "eval_size": 4,
            "progress": False,
            "dynamic_sampling": False,
            "checkpoint_every_s": 0,
        }
        | pipeline,
        "objective": {"advantages": "whiten"},
        "run_dir": str(run_dir),
    }
    return build_run_config(apply_overrides(base, list(overrides)))


def steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_checkpoints_are_periodic_by_default_and_time_based(letter_env, tmp_path):
    assert PipelineSection().checkpoint_every_s > 0  # a SIGKILL of a default run loses minutes, not the run
    run = tmp_path / "run"
    seen: list[str | None] = []
    cfg = config(letter_env, run, total_steps=3, eval_every=0, checkpoint_every_s=1e-6)

    import labrl.harness.pipeline.runner as runner

    original = runner.JsonlWriter.write

    def spy(self, record):  # which checkpoint exists when each metrics record is written
        if self.path.name == "metrics.jsonl":
            latest = run / "checkpoints" / "latest"
            seen.append(latest.read_text() if latest.exists() else None)
        return original(self, record)

    runner.JsonlWriter.write = spy
    try:
        import asyncio

        asyncio.run(train(cfg))
    finally:
        runner.JsonlWriter.write = original
    # metrics of step N are written before step N's periodic checkpoint: step 2 sees step 1's
    assert seen == [None, "step_000001", "step_000002"]


async def test_resume_refuses_a_different_identity_and_logs_tunable_changes(letter_env, tmp_path):
    run = tmp_path / "run"
    await train(config(letter_env, run, total_steps=1, eval_every=0))
    before = (run / "config.yaml").read_text()
    for override, key in (
        ("env.options={error_every: 3}", "env.options"),
        ("model.overrides.hidden_size=48", "model.shape"),
        ("objective.loss=ppo", "objective.loss"),
        ("seed=1", "seed"),
    ):
        with pytest.raises(ConfigError, match=rf"cannot resume .*different {re.escape(key)} "):
            await train(config(letter_env, run, override, total_steps=2, eval_every=0))
        assert (run / "config.yaml").read_text() == before  # refused before anything is written
    summary = await train(
        config(letter_env, run, "learner.optimizer.lr=3e-4", total_steps=2, eval_every=0, max_staleness=2)
    )
    assert summary["step"] == 2
    changes = [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()]
    assert changes == [
        {
            "step": 1,
            "changed": {
                "learner.optimizer.lr": [0.001, 0.0003],
                "pipeline.max_staleness": [1, 2],
                "pipeline.total_steps": [1, 2],
            },
        }
    ]


def test_a_multi_process_launch_is_refused():
    """torchrun's WORLD_SIZE > 1: every rank would run its own driver (docs/gpu.md)."""
    refuse_a_multi_process_launch({})
    refuse_a_multi_process_launch({"WORLD_SIZE": "1", "RANK": "0"})
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=4: labrl train runs one process"):
        refuse_a_multi_process_launch({"WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="not a process count"):
        refuse_a_multi_process_launch({"WORLD_SIZE": "four"})


async def test_a_multi_process_launch_writes_nothing(letter_env, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="a learner over several is not built"):
        await train(config(letter_env, tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_resume_identity_names_every_differing_key(tmp_path):
    a = config("xrd/phase-id-v0", tmp_path)
    b = config("sim/lattice-constant-v0", tmp_path, "model.overrides.num_layers=2", "pipeline.group_size=4")
    with pytest.raises(ConfigError) as err:
        check_resume(a, b)
    message = str(err.value)
    assert "different env.id, model.shape, pipeline.group_size (" in message
    assert '"xrd/phase-id-v0" -> "sim/lattice-constant-v0"' in message
    assert set(IDENTITY_KEYS) >= {"env.id", "env.options", "model.shape", "tokenizer", "objective.loss"}
    assert check_resume(a, config("xrd/phase-id-v0", tmp_path, "pipeline.eval_every=5")) == {
        "pipeline.eval_every": (1, 5)
    }


def test_truncate_keeps_each_step_once_up_to_the_checkpoint(tmp_path):
    rows = [1, 2, 3, 4, 2, 3, 4, 5, 3]  # two kills: steps written after checkpoints at 1 and 2
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in rows) + '{"st')
    (tmp_path / "errors.jsonl").write_text(
        "".join(json.dumps({"step": s, "kind": "episode"}) + "\n" for s in (1, 1, 3))
        + json.dumps({"step": None, "kind": "internal"})
        + "\n"
    )
    dropped = truncate_run_logs(tmp_path, 3)
    assert steps(tmp_path / "metrics.jsonl") == [1, 2, 3]
    assert steps(tmp_path / "errors.jsonl") == [1, 1, 3, None]
    assert dropped == {"metrics.jsonl": 7}
    truncate_run_logs(tmp_path, -1)  # a fresh start
    assert steps(tmp_path / "metrics.jsonl") == [] and steps(tmp_path / "errors.jsonl") == [None]


async def test_env_and_verifier_failures_are_rated_logged_and_reported(letter_env, tmp_path, capsys):
    run = tmp_path / "run"
    cfg = config(
        letter_env, run, "env.options={error_every: 4, verifier_fail_every: 4}", total_steps=3, eval_size=8
    )
    await train(cfg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    finished = sum(r["episodes/finished"] for r in rows)
    env_errors = sum((r["errors/env_error_frac"] or 0.0) * r["episodes/finished"] for r in rows)
    assert all((r["errors/env_error_frac"] is None) == (r["episodes/finished"] == 0) for r in rows)
    assert finished > 0 and 0 < env_errors < finished
    assert rows[-1]["errors/env_error_total"] == round(env_errors)
    by_env = rows[-1]["errors/by_env"]["test/letter-v0"]
    assert by_env["env_error"] == round(env_errors) and by_env["verifier_failed"] > 0
    busy = next(r for r in rows if r["episodes/finished"])  # the last step may have none in its window
    assert f"env_error/verifier_failed {busy['errors/env_error_frac']:.2f}/" in summary_line(busy, 3)
    assert "env_error/verifier_failed -/-" in summary_line(busy | {"errors/env_error_frac": None,
                                                                    "errors/verifier_failed_frac": None}, 3)  # fmt: skip
    errors = distinct_errors(run)
    # one distinct error per fault and phase (task ids differ), its first occurrence in full, repeats counted
    (train_error,) = [e for e in errors if e["phase"] == "train" and e["outcome"] == "env_error"]
    # every failure the metrics counted is in the log (groups finishing after the last step add more)
    assert train_error["count"] >= rows[-1]["errors/env_error_total"] > 1
    assert re.fullmatch(r"EnvError: letter backend down for task letter-train-\d+", train_error["message"])
    assert "pipeline_fakes.py" in train_error["traceback"]
    assert "EnvError: letter backend down" in train_error["traceback"]
    assert any(e["outcome"] == "verifier_failed" and "letter verifier broke" in e["message"] for e in errors)
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert all(e["errors/env_error_frac"] == 2 / 8 for e in evals)  # test seeds 0 and 4 of 0..7
    assert any(e["phase"] == "eval" for e in errors)
    report = write_report(run)
    assert "env_error" in report.summary and (run / "report" / "errors.png").stat().st_size > 1000


async def test_an_internal_error_is_one_line_with_the_traceback_in_the_errors_log(
    letter_env, tmp_path, monkeypatch
):
    run = tmp_path / "run"
    from labrl.harness.pipeline import orchestrator

    def broken_collate(*args, **kwargs):
        raise ValueError("need at least one array to concatenate")

    monkeypatch.setattr(orchestrator, "collate", broken_collate)
    with pytest.raises(RunFailedError) as err:
        await train(config(letter_env, run, eval_every=0))
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("internal error at step 0: ValueError: need at least one array to concatenate")
    assert str(run / "errors.jsonl") in line
    (record,) = [json.loads(x) for x in (run / "errors.jsonl").read_text().splitlines() if '"internal"' in x]
    assert record["error"] == "ValueError" and "broken_collate" in record["traceback"]
    # the run stopped with a checkpoint first: nothing trained is lost, a rerun resumes
    assert (run / "checkpoints" / "latest").read_text() == "step_000000"
