"""`model.init_from_hf`: training starts from a Hugging Face MoE checkpoint on disk."""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_pipeline_train_e2e import TINY, run_config

from labrl.errors import ConfigError
from labrl.harness.backends.parts import build_learner, build_tokenizer, initialise_from_hf
from labrl.harness.config import build_run_config
from labrl.harness.models.hf_export import export_hf_checkpoint
from labrl.harness.pipeline.runner import train
from labrl.harness.tokenizer import HFTokenizer


def _export_source(tmp_path, letter_env, seed: int):
    """An HF checkpoint (Qwen3-MoE layout, with tokenizer files) of a tiny model initialised with ``seed``."""
    raw = run_config(letter_env, tmp_path / "unused")
    raw["model"]["overrides"] = TINY | {"qk_layernorm": True}
    raw["seed"] = seed
    cfg = build_run_config(raw)
    learner = build_learner(cfg)
    state = learner.export_weights()
    return export_hf_checkpoint(state, cfg.model.resolve(), tmp_path / "hf"), state


def test_learner_starts_from_the_checkpoint_weights(letter_env, tmp_path):
    path, source_state = _export_source(tmp_path, letter_env, seed=123)
    raw = run_config(letter_env, tmp_path / "run")
    raw["model"] = {"init_from_hf": str(path)}
    cfg = build_run_config(raw)
    assert isinstance(build_tokenizer(cfg), HFTokenizer)
    learner = build_learner(cfg)  # seed 0: different random init
    fresh = learner.export_weights()
    assert any(not torch.equal(fresh[k], source_state[k]) for k in source_state)
    initialise_from_hf(learner, str(path), cfg.model.resolve())
    loaded = learner.export_weights()
    assert sorted(loaded) == sorted(source_state)
    assert all(torch.equal(loaded[k], source_state[k]) for k in source_state)


async def test_train_runs_from_an_hf_checkpoint(letter_env, tmp_path):
    path, _ = _export_source(tmp_path, letter_env, seed=7)
    raw = run_config(letter_env, tmp_path / "run", total_steps=2, eval_every=0)
    raw["model"] = {"init_from_hf": str(path)}
    raw["sft"] = {"enabled": False}
    summary = await train(build_run_config(raw))
    assert summary["step"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples/trained"] for r in rows] == [8, 8]


def test_missing_checkpoint_is_a_config_error(letter_env, tmp_path):
    raw = run_config(letter_env, tmp_path / "run")
    raw["model"] = {"init_from_hf": str(tmp_path / "nowhere")}
    with pytest.raises(
        ConfigError, match=re.escape(f"model.init_from_hf={str(tmp_path / 'nowhere')!r}: no config.json")
    ):
        build_run_config(raw).model.resolve()
