"""A run writes what its auto and mode-derived keys resolved to, and resume holds it to that dtype.

Real components (tiny MoE, LocalSampler, MegatronLearner) on the fake letter env.
"""

from __future__ import annotations

import json
import re

import pytest
from test_run_resume_and_errors import config

from labrl.errors import ConfigError
from labrl.harness.effective import EFFECTIVE_FILE, effective_values
from labrl.harness.pipeline.runner import train


async def test_effective_values_are_written_and_a_changed_dtype_is_not_resumed(letter_env, tmp_path):
    run = tmp_path / "run"
    cfg = config(letter_env, run, "pipeline.mode=sync", total_steps=1, eval_every=0)
    await train(cfg)
    written = json.loads((run / EFFECTIVE_FILE).read_text())
    assert written == effective_values(cfg).as_config_keys()
    assert written["pipeline.max_staleness"] == 0 and cfg.pipeline.max_staleness == 1  # sync acts as 0
    assert written["learner.precision"] == "fp32"  # auto on this CPU machine

    # the checkpoint was trained in bf16 (as auto resolves on CUDA): this machine would resolve fp32
    trained_in = written | {"learner.precision": "bf16", "learner.device": "cuda:0"}
    (run / EFFECTIVE_FILE).write_text(json.dumps(trained_in))
    before = (run / "config.yaml").read_text()
    with pytest.raises(
        ConfigError,
        match=r"cannot resume .*different learner\.precision "
        + re.escape('(learner.precision: "bf16" -> "fp32")'),
    ):
        await train(config(letter_env, run, "pipeline.mode=sync", total_steps=2, eval_every=0))
    assert (run / "config.yaml").read_text() == before  # refused before anything is written
    assert json.loads((run / EFFECTIVE_FILE).read_text()) == trained_in
