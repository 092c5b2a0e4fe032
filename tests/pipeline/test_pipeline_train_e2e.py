"""End to end with the real components: tiny MoE, LocalSampler, MegatronLearner, `labrl train` / `labrl report`."""

from __future__ import annotations

import json

import yaml
from run_configs import replay_training

from labrl.cli import main
from labrl.harness.config import build_run_config
from labrl.harness.pipeline.runner import train
from labrl.harness.pipeline.traces import read_episode_traces

TINY = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "ffn_hidden_size": 64,
        "moe_ffn_hidden_size": 32, "num_experts": 4, "max_sequence_length": 64}  # fmt: skip


def run_config(env_id: str, run_dir, **pipeline) -> dict:
    return {
        "env": {"id": env_id},
        "model": {"preset": "tiny-moe", "overrides": TINY},
        "sampler": {"max_new_tokens": 3, "local": {"max_batch_size": 16}},
        **replay_training(8),
        "pipeline": {
            "mode": "pipeline",
            "batch_groups": 2,
            "group_size": 4,
            "max_staleness": 2,
            "total_steps": 3,
            "eval_every": 2,
            "eval_size": 4,
            "progress": False,
        }
        | pipeline,
        "sft": {"enabled": True, "steps": 2, "batch_size": 4, "num_prompts": 4},
        "run_dir": str(run_dir),
    }


async def test_train_writes_a_run_directory_resumes_and_reports(letter_env, tmp_path, capsys):
    run = tmp_path / "run"
    summary = await train(build_run_config(run_config(letter_env, run)))
    assert summary["step"] == 3 and not summary["interrupted"]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["learner/router_replay"] == 1.0 for r in rows)  # routed experts reached the learner
    assert all(r["samples/trained"] == 8 for r in rows)
    # the learner's whole step (train_step, export, publish) holds train_step and is within the wall time
    assert all(0 < r["busy/learner"] < r["busy/learner_step"] <= 1 for r in rows)
    assert [json.loads(x)["step"] for x in (run / "eval.jsonl").read_text().splitlines()] == [0, 2, 3]
    assert len((run / "sft.jsonl").read_text().splitlines()) == 2
    assert (run / "checkpoints" / "latest").read_text() == "step_000003"
    assert "id: test/letter-v0" in (run / "config.yaml").read_text()

    # a second invocation with more steps resumes from the checkpoint (no warm start, no group twice)
    summary = await train(build_run_config(run_config(letter_env, run, total_steps=4)))
    assert summary["step"] == 4
    trained = [g for x in (run / "trained.jsonl").read_text().splitlines() for g in json.loads(x)["groups"]]
    assert len(trained) == len(set(trained)) == 8
    assert len((run / "sft.jsonl").read_text().splitlines()) == 2
    # episodes.jsonl: every trained episode once, across the resume, as metrics.jsonl counts them
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    traced = [t for t in read_episode_traces(run) if t["fate"] == "trained"]
    assert len(traced) == sum(r["samples/trained"] for r in rows) == 32
    assert {t["group"] for t in traced} == set(trained)
    assert all(t["version_at_start"] <= t["token_versions"][0] <= t["version_at_train"] for t in traced)

    # labrl plan calibrates from the real run's files
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run_config(letter_env, tmp_path / "unused")))
    assert main(["plan", str(config), "--from-run", str(run), "--steps", "20", "--top", "2"]) == 0
    planned = capsys.readouterr().out
    planned = planned[planned.index("calibrated: ") :].splitlines()
    assert "keep rate" in planned[0] and "learner" in planned[1]
    (own,) = [line for line in planned if line.startswith("* ") and "pipeline." in line]
    assert "pipeline.max_concurrent_episodes=256 pipeline.max_staleness=2" in own

    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "steps: 4  mode: pipeline" in out
    for name in ("reward", "staleness", "is_ratio", "masked", "env_latency", "throughput"):
        assert (run / "report" / f"{name}.png").stat().st_size > 1000


def test_train_command_rejects_a_typo_with_the_key_name(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("env:\n  id: test/letter-v0\n")
    assert main(["train", str(cfg), "pipeline.totl_steps=3"]) == 2
    err = capsys.readouterr().err
    assert "pipeline.totl_steps: unknown key; did you mean pipeline.total_steps?" in err


def test_report_on_a_directory_without_metrics_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert f"{tmp_path} has no metrics.jsonl: is it a labrl run directory?" in capsys.readouterr().err
