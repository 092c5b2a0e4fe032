"""``benchmarks/cascade.py``: the arms' configs, the merge's ratios on a fixture, and a tiny run in parts."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from labrl.envs.cascade import Informative, cascade_reward
from labrl.envs.cascade.config import MIN_AUDIT_PROBABILITY
from labrl.harness.backends.parts import make_env_factory

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
TINY = [
    "sft.steps=80", "sft.batch_size=8", "sft.num_prompts=64", "pipeline.total_steps=2", "pipeline.eval_every=1",
    "pipeline.eval_size=2", "pipeline.batch_groups=1", "pipeline.group_size=4", "learner.optimizer.total_steps=2",
]  # fmt: skip


def bench() -> ModuleType:
    """The script as a module; benchmarks/ goes on ``sys.path`` (last): it imports its helpers beside it."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    return importlib.import_module("cascade")


@pytest.mark.parametrize("arm", ["always-expensive", "always-cheap", "cascade", "informative"])
def test_every_arm_parses_and_builds_its_env(arm, tmp_path):
    cfg = bench().load_arm_config(arm, 1, tmp_path / "run")
    env = make_env_factory(cfg)().unwrapped
    assert env.cascade.test_split_at_truth and env.cascade.budgets == {}
    assert env.cascade.ledger_path == str(tmp_path / "run" / "cascade-ledger.sqlite")
    assert (cfg.seed, env.cascade.seed) == (1, 1)
    # the benchmark's band: a task a tiny model learns in 100 steps (it moves its answers onto it)
    targets = [env.make_task(split, i).answer for split in ("train", "test") for i in range(100)]
    assert min(targets) >= 0.25 and max(targets) <= 0.35


def test_the_arms_say_what_they_claim():
    b = bench()
    expensive = b.load_arm_config("always-expensive", 0, Path("r"))
    cheap = b.load_arm_config("always-cheap", 0, Path("r"))
    assert expensive.cascade.audit_probability == 1.0  # r = c + (e - c) / 1 = e
    assert cheap.cascade.audit_probability == MIN_AUDIT_PROBABILITY
    assert cheap.env.options["pass_threshold"] > 1e6  # no proxy value passes
    assert cascade_reward([0.7], []) == 0.7  # a candidate stopped and not audited gets the proxy alone
    informative = b.load_arm_config("informative", 0, Path("r"))
    rule = make_env_factory(informative)().unwrapped.stages[0].pass_on
    assert isinstance(rule, Informative) and (rule.z, rule.noise) == (0.1, 0.1)  # noise: the proxy's
    assert (
        informative.cascade.audit_probability
        == b.load_arm_config("cascade", 0, Path("r")).cascade.audit_probability
    )


def _part(arm: str, seed: int, curve: list[tuple[int, float, float]]) -> dict:
    points = [
        {"step": s, "heldout_truth": r, "truth_gpu_h": c, "truth_calls": round(c * 1000)} for s, r, c in curve
    ]
    return {
        "arm": arm,
        "seed": seed,
        "curve": points,
        "final_heldout_truth": points[-1]["heldout_truth"],
        "truth_gpu_h": points[-1]["truth_gpu_h"],
        "train_truth_calls": points[-1]["truth_calls"],
        "reward_truth_corr": 0.5,
    }


def test_the_merge_computes_the_ratios_and_the_goal_on_a_fixture(tmp_path):
    parts = [
        _part("always-expensive", 0, [(0, 0.2, 0.0), (10, 0.6, 0.4), (20, 0.8, 0.8)]),
        _part(
            "always-expensive", 1, [(0, 0.2, 0.0), (10, 0.5, 0.6), (20, 0.7, 1.2)]
        ),  # final median 0.75, 1.0 GPU-h
        _part("cascade", 0, [(0, 0.2, 0.0), (10, 0.78, 0.1), (20, 0.8, 0.3)]),
        _part("cascade", 1, [(0, 0.2, 0.0), (10, 0.76, 0.2), (20, 0.7, 0.5)]),  # reach at step 10: 0.15 GPU-h
        _part("always-cheap", 0, [(0, 0.2, 0.0), (20, 0.3, 0.0)]),
        _part("informative", 0, [(0, 0.2, 0.0), (10, 0.3, 0.2), (20, 0.25, 0.3)]),  # below always-cheap
    ]
    for p in parts:
        (tmp_path / f"{p['arm']}_{p['seed']}.json").write_text(json.dumps(p))
    summary = bench().merge(tmp_path, tmp_path / "out")
    arms = summary["arms"]
    assert arms["always-expensive"]["final_median"] == pytest.approx(0.75)
    assert arms["always-expensive"]["truth_gpu_h"] == pytest.approx(1.0)
    assert arms["always-expensive"]["compute_ratio"] == pytest.approx(1.0)
    assert arms["cascade"]["truth_gpu_h"] == pytest.approx(0.4)
    assert arms["cascade"]["compute_ratio"] == pytest.approx(0.4)
    assert arms["cascade"]["final_range"] == [0.7, 0.8]
    assert arms["cascade"]["reach_gpu_h"] == pytest.approx(0.15)
    assert arms["cascade"]["reach_ratio"] == pytest.approx(0.15)
    assert arms["always-cheap"]["reach_ratio"] is None and arms["always-cheap"]["compute_ratio"] == 0.0
    assert summary["goal"] == {
        "cascade": {"reaches_baseline_within_share": True, "beats_always_cheap": True},
        "informative": {"reaches_baseline_within_share": False, "beats_always_cheap": False},
    }
    assert (tmp_path / "out" / "cascade.png").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "cascade.json").read_text())["arms"]["cascade"][
        "reach_ratio"
    ] == pytest.approx(0.15)


def test_the_probe_scores_a_group_rule_in_groups_and_reprobe_redoes_it_alone(tmp_path):
    b = bench()
    path = tmp_path / "informative_0.json"
    path.write_text(json.dumps({**_part("informative", 0, [(0, 0.2, 0.0)]), "reward_truth_corr": 9.0}))
    b.main(["--reprobe", "--parts", str(tmp_path)])
    part = json.loads(path.read_text())
    # Informative decides by the group: scored without a GroupGate its episodes would fail
    assert part["probe_size"] == 256 and -1.0 <= part["reward_truth_corr"] <= 1.0
    assert part["final_heldout_truth"] == 0.2  # the run's own figures are kept


def test_a_ledger_key_names_its_split_and_task():
    assert bench().task_id_of("synthetic/cascade-v0/train/12/train-12/truth/0123abcd") == (
        "train",
        "train-12",
    )


@pytest.mark.slow
def test_two_tiny_parts_and_their_merge(tmp_path, capsys):
    b = bench()
    for arm in ("always-expensive", "always-cheap"):
        extra = [f"--set={x}" for x in TINY]
        argv = [
            "--arm",
            arm,
            "--seed",
            "0",
            *extra,
            "--runs",
            str(tmp_path / "runs"),
            "--parts",
            str(tmp_path),
        ]
        assert b.main(argv) == 0
    expensive = json.loads((tmp_path / "always-expensive_0.json").read_text())
    cheap = json.loads((tmp_path / "always-cheap_0.json").read_text())
    assert [p["step"] for p in expensive["curve"]] == [0, 1, 2]
    # 80 SFT steps put the policy on format: its candidates reach the ledger
    assert expensive["train_truth_calls"] > 0
    assert expensive["truth_gpu_h"] == pytest.approx(0.001 * expensive["train_truth_calls"])
    assert expensive["curve"][-1]["truth_gpu_h"] <= expensive["truth_gpu_h"]
    assert expensive["reward_truth_corr"] == pytest.approx(1.0)  # its reward is the truth
    assert (
        cheap["train_truth_calls"] == 0 and cheap["truth_gpu_h"] == 0.0
    )  # every trained reward was the proxy
    assert cheap["reward_truth_corr"] < 0.9 and abs(cheap["reward_minus_truth_mean"]) > 0.05  # biased proxy
    summary = b.merge(tmp_path, tmp_path / "out")
    assert summary["arms"]["always-expensive"]["compute_ratio"] == 1.0
    assert summary["arms"]["always-cheap"]["compute_ratio"] == 0.0
    assert "always-cheap" in capsys.readouterr().out
