"""configs/cascade-chgnet-pyscf.yaml trains end to end with ``labrl train`` (two steps, shrunk)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from labrl.cli import main
from labrl.harness.backends.parts import make_env_factory
from labrl.harness.config import load_run_config

CONFIG = Path(__file__).parents[2] / "configs" / "cascade-chgnet-pyscf.yaml"
SHRINK = [
    "sft.steps=2", "sft.batch_size=2", "sft.num_prompts=2", "pipeline.total_steps=2",
    "pipeline.eval_every=2", "pipeline.eval_size=2", "pipeline.batch_groups=1", "pipeline.group_size=2",
    "pipeline.progress=false",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("chgnet") is None or importlib.util.find_spec("pyscf") is None,
    reason="needs CHGNet and PySCF: pip install 'labrl[chgnet,dft]'",
)
def test_the_chgnet_pyscf_config_trains_end_to_end(tmp_path, capsys):
    run = tmp_path / "run"
    overrides = [*SHRINK, f"run_dir={run}", f"cascade.ledger_path={tmp_path / 'ledger.sqlite'}"]
    assert main(["train", str(CONFIG), *overrides]) == 0, capsys.readouterr()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["errors/env_error_total"] == rows[-1]["errors/verifier_failed_total"] == 0


def test_the_run_hands_its_cascade_section_to_the_env(tmp_path):
    cfg = load_run_config(CONFIG, [f"cascade.ledger_path={tmp_path / 'ledger.sqlite'}"])
    env = make_env_factory(cfg)()
    assert env.unwrapped.cascade == cfg.cascade
    assert env.unwrapped.cascade.budgets["dft"].limit == 3600.0
    assert env.unwrapped.stages[0].pass_on.min_reward == 0.5
