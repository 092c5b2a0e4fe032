"""Bad sizes and numbers are a ConfigError naming the key, before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from labrl.cli import main
from labrl.harness.config import learnability_warnings, load_run_config
from labrl.harness.config import non_finite_keys as non_finite_keys

ROOT = Path(__file__).parents[2]

BAD = {
    "pipeline.max_concurrent_episodes=1000000000": "pipeline.max_concurrent_episodes: Input should be less than or equal to 65536",
    "pipeline.eval_size=1000000000": "pipeline.eval_size: Input should be less than or equal to 100000",
    "learner.optimizer.lr=.inf": "every number of a run config must be finite: learner.optimizer.lr=inf",
    "objective.kl_coef=.inf": "every number of a run config must be finite: objective.kl_coef=inf",
    "pipeline.torch_threads=100000": "pipeline.torch_threads: Input should be less than or equal to 1024",
    "run_dir=": "run_dir: String should have at least 1 character",
    "run_dir=' '": "run_dir is empty: name a directory",
    # valid for pydantic, rejected by the checks that build the run: still nothing written
    "model.overrides.vocab_size=100": "model vocab_size 100 differs from the tokenizer's",
}


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty run_dir used to write into the working directory
    path = tmp_path / "c.yaml"
    path.write_text("env: {id: xrd/phase-id-v0}\nrun_dir: out/run\n")
    return path


@pytest.mark.parametrize("override", BAD, ids=list(BAD))
def test_bad_values_fail_before_anything_is_written(config, tmp_path, capsys, override):
    assert main(["train", str(config), override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("labrl: error: ") and BAD[override] in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]  # no run dir, no config.yaml


def test_retrying_all_wrong_groups_without_dynamic_sampling_is_refused(config, tmp_path, capsys):
    """With dynamic sampling off an all-wrong group is trained, never dropped: the retry would never run."""
    assert main(["train", str(config), "pipeline.retry_all_wrong=2", "pipeline.dynamic_sampling=false"]) == 2
    err = capsys.readouterr().err
    assert "pipeline.retry_all_wrong=2 needs pipeline.dynamic_sampling: true" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_an_unknown_env_option_fails_before_anything_is_written(config, tmp_path, capsys):
    assert main(["train", str(config), "env.options={no_such_option: 1}"]) == 2
    assert "no_such_option" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_a_config_that_will_not_learn_says_why(config):
    (warning,) = learnability_warnings(load_run_config(config))
    assert warning.startswith("sft.enabled=false with a from-scratch model") and "sft.enabled=true" in warning
    assert learnability_warnings(load_run_config(config, ["sft.enabled=true"])) == []
    assert learnability_warnings(load_run_config(ROOT / "configs" / "quickstart.yaml")) == []


def test_the_shipped_defaults_are_finite():
    from labrl.harness.config import RunConfig

    assert non_finite_keys(RunConfig(env={"id": "x"})) == []
