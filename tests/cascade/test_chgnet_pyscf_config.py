"""configs/cascade-chgnet-pyscf.yaml trains end to end with ``labrl train`` (two steps, shrunk)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from cascade_fakes import assert_trains_two_steps

from labrl.harness.backends.parts import make_env_factory
from labrl.harness.config import load_run_config

CONFIG = Path(__file__).parents[2] / "configs" / "cascade-chgnet-pyscf.yaml"


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("chgnet") is None or importlib.util.find_spec("pyscf") is None,
    reason="needs CHGNet and PySCF: pip install 'labrl[chgnet,dft]'",
)
def test_the_chgnet_pyscf_config_trains_end_to_end(tmp_path, capsys):
    assert_trains_two_steps(
        CONFIG, tmp_path / "run", [f"cascade.ledger_path={tmp_path / 'ledger.sqlite'}"], capsys
    )


def test_the_run_hands_its_cascade_section_to_the_env(tmp_path):
    cfg = load_run_config(CONFIG, [f"cascade.ledger_path={tmp_path / 'ledger.sqlite'}"])
    env = make_env_factory(cfg)()
    assert env.unwrapped.cascade == cfg.cascade
    assert env.unwrapped.cascade.budgets["dft"].limit == 3600.0
    assert env.unwrapped.stages[0].pass_on.min_reward == 0.5
