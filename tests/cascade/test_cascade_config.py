"""configs/cascade-synthetic.yaml trains end to end with ``labrl train`` (two steps, shrunk)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from cascade_fakes import assert_trains_two_steps

from labrl.envs import Action
from labrl.envs.cascade import CascadeRecord
from labrl.errors import ConfigError
from labrl.harness.backends.parts import CASCADE_LEDGER_FILE, make_env_factory
from labrl.harness.config import load_run_config

CONFIG = Path(__file__).parents[2] / "configs" / "cascade-synthetic.yaml"


@pytest.mark.slow
def test_the_cascade_config_trains_end_to_end(tmp_path, capsys):
    assert_trains_two_steps(CONFIG, tmp_path / "run", [], capsys)


def test_the_run_hands_its_cascade_section_to_the_env(tmp_path):
    cfg = load_run_config(CONFIG, [f"cascade.ledger_path={tmp_path / 'ledger.sqlite'}"])
    env = make_env_factory(cfg)()
    assert env.unwrapped.cascade == cfg.cascade
    assert env.unwrapped.cascade.budgets["truth"].limit == 10.0
    assert env.unwrapped.cascade.control_variate.kind == "proxy"  # the plain estimator unless asked
    learnt = load_run_config(
        CONFIG, ["cascade.control_variate.kind=nearest_truths", "cascade.control_variate.neighbours=4"]
    )
    assert make_env_factory(learnt)().unwrapped.cascade.control_variate.neighbours == 4
    with pytest.raises(ConfigError, match="neighbour"):
        load_run_config(CONFIG, ["cascade.control_variate.neighbour=4"])
    both = load_run_config(CONFIG, ["env.options.cascade={seed: 1}"])
    with pytest.raises(ConfigError, match="not both"):
        make_env_factory(both)


def test_the_ledger_defaults_to_the_run_dir_and_a_resume_pays_nothing_twice(tmp_path):
    """A stage paid before a crash is answered from the run's ledger after it: the (task, stage,
    candidate) key is charged once, across processes (here: two event loops, two factories)."""
    run = tmp_path / "run"

    def play_once() -> CascadeRecord:
        factory = make_env_factory(load_run_config(CONFIG, [f"run_dir={run}", "cascade.audit_probability=1"]))

        async def play():
            env = factory()
            try:
                task = env.make_task("train", 3)
                await env.reset(task)
                return await env.step(Action(text="<answer>0.42</answer>"))
            finally:
                await env.close()

        return CascadeRecord.model_validate(asyncio.run(play()).info["cascade"])

    before = play_once()
    assert (run / CASCADE_LEDGER_FILE).is_file()
    after = play_once()  # the resumed run: same run_dir, a fresh process
    assert [(s.stage, s.reused, s.cost) for s in before.stages] == [
        ("proxy", False, 0.01),
        ("truth", False, 0.001),
    ]
    assert [(s.reused, s.cost) for s in after.stages] == [(True, 0.0), (True, 0.0)]
    assert after.reward == before.reward
