"""configs/cascade-synthetic.yaml trains end to end with ``labrl train`` (two steps, shrunk)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from labrl.cli import main
from labrl.errors import ConfigError
from labrl.harness.backends.parts import make_env_factory
from labrl.harness.config import load_run_config

CONFIG = Path(__file__).parents[2] / "configs" / "cascade-synthetic.yaml"
SHRINK = [
    "sft.steps=2", "sft.batch_size=2", "sft.num_prompts=2", "pipeline.total_steps=2",
    "pipeline.eval_every=2", "pipeline.eval_size=2", "pipeline.batch_groups=1", "pipeline.group_size=2",
    "pipeline.progress=false",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("rule", [[], ["env.options.top_k=1"]], ids=["threshold", "top_k"])
def test_the_cascade_config_trains_end_to_end(tmp_path, capsys, rule):
    run = tmp_path / "run"
    overrides = [*SHRINK, *rule, f"run_dir={run}", f"cascade.ledger_path={tmp_path / 'ledger.sqlite'}"]
    assert main(["train", str(CONFIG), *overrides]) == 0, capsys.readouterr()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["errors/env_error_total"] == rows[-1]["errors/verifier_failed_total"] == 0


def test_the_run_hands_its_cascade_section_to_the_env(tmp_path):
    cfg = load_run_config(CONFIG, [f"cascade.ledger_path={tmp_path / 'ledger.sqlite'}"])
    env = make_env_factory(cfg)()
    assert env.unwrapped.cascade == cfg.cascade
    assert env.unwrapped.cascade.budgets["truth"].limit == 10.0
    both = load_run_config(CONFIG, ["env.options.cascade={seed: 1}"])
    with pytest.raises(ConfigError, match="not both"):
        make_env_factory(both)
