"""``materials/cascade-chgnet-pyscf-v0``: CHGNet screens a lattice constant, PySCF DFT is the truth.

The tests marked slow run the real calculators (a PySCF single point of a diatomic in a 4 Å box:
about half a CPU-second).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from cascade_fakes import play_one_step

from labrl.envs import Outcome, check_env, make
from labrl.envs.cascade import CascadeRecord, CostUnit
from labrl.envs.sim.cascade_references import MOLECULES, REFERENCES_PATH, SEARCH_WINDOW, load_references
from labrl.errors import ConfigError, EnvError

ENV_ID = "materials/cascade-chgnet-pyscf-v0"

needs_calculators = pytest.mark.skipif(
    importlib.util.find_spec("chgnet") is None or importlib.util.find_spec("pyscf") is None,
    reason="needs CHGNet and PySCF: pip install 'labrl[chgnet,dft]'",
)


def test_the_references_hold_a_biased_screen_and_a_plausible_truth():
    references = load_references()
    lo, hi = SEARCH_WINDOW
    for molecule, m in MOLECULES.items():
        chgnet, dft = references[molecule]["chgnet"]["d"], references[molecule]["pyscf"]["d"]
        assert lo * m.d_exp < dft < hi * m.d_exp and lo * m.d_exp < chgnet < hi * m.d_exp, molecule
        assert abs(chgnet - dft) > 0.01, molecule  # the screen's optimum is not the truth's
        assert all(s > 0 for s in references[molecule]["pyscf"]["cpu_s_per_call"])


def test_references_made_under_other_calculator_settings_are_refused(tmp_path):
    document = json.loads(REFERENCES_PATH.read_text())
    document["settings"]["pyscf_ke_cutoff_ha"] = 80.0
    path = tmp_path / "references.json"
    path.write_text(json.dumps(document))
    with pytest.raises(
        ConfigError, match=r"regenerate it with python -m labrl\.envs\.sim\.cascade_references"
    ):
        load_references(path)


def test_the_stages_are_priced_in_measured_cpu_seconds():
    env = make(ENV_ID).unwrapped
    chgnet, dft = env.stages
    assert (chgnet.name, dft.name) == ("chgnet", "dft")
    assert chgnet.cost_unit is dft.cost_unit is CostUnit.CPU_S
    assert 0 < chgnet.cost < dft.cost  # the measured medians: DFT costs more than the screen
    assert chgnet.pass_on.min_reward == 0.5
    assert make(ENV_ID, top_k=2, dft_cost_cpu_s=9.0).unwrapped.stages[1].cost == 9.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"molecules": ["N2", "CO"]}, "leave a split empty"),
        ({"molecules": ["N2", "H2O"]}, "unknown molecule"),
        ({"cascade": {"budgets": {"dft": {"limit": 1.0, "unit": "gpu_h"}}}}, "charged in cpu_s"),
        ({"cascade": {"budgets": {"pyscf": {"limit": 1.0, "unit": "cpu_s"}}}}, "has no stage 'pyscf'"),
    ],
)
def test_bad_options_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        make(ENV_ID, **options)


async def test_an_implausible_constant_is_an_invalid_action_before_any_calculation():
    env = make(ENV_ID)
    result = await play_one_step(env, env.make_task("test", 0), "<answer>9.9</answer>")
    assert result.outcome is Outcome.INVALID_ACTION and "no plausible bond length for HF" in (
        result.observation.messages[0].content
    )


@pytest.mark.parametrize("failing", ["chgnet", "dft"])
async def test_a_failing_calculator_is_verifier_failed_naming_the_stage(failing):
    """The calculators are replaced: CHGNet answers the reference energy (reward 1), one of them fails."""
    env = make(ENV_ID, cascade={"audit_probability": 1.0})
    inner = env.unwrapped
    task = env.make_task("test", 0)
    reference = inner.references["HF"]["chgnet"]["e_ref_per_atom_ev"]

    async def answers(task_name, structure, **params):
        return {"energy_per_atom_ev": reference}

    async def fails(task_name, structure, **params):
        raise EnvError("the calculator crashed")

    inner.calculators["chgnet"].run = answers
    inner.calculators["dft"].run = answers
    inner.calculators[failing].run = fails
    result = await play_one_step(env, task, "<answer>0.92</answer>")
    assert result.outcome is Outcome.VERIFIER_FAILED and result.reward is None
    assert f"cascade stage {failing!r} failed" in result.info["error"]
    assert "the calculator crashed" in result.info["error"]


@pytest.mark.slow
@needs_calculators
async def test_the_right_bond_length_beats_a_wrong_one_at_both_stages():
    env = make(ENV_ID, cascade={"audit_probability": 1.0})
    task = env.make_task("test", 0)
    gold = env.gold_actions(task)[0].text
    right = CascadeRecord.model_validate((await play_one_step(env, task, gold)).info["cascade"])
    wrong_d = MOLECULES["HF"].d_exp * 0.82  # compressed: both calculators say so
    wrong_env = make(ENV_ID, cascade={"audit_probability": 1.0})
    wrong = CascadeRecord.model_validate(
        (await play_one_step(wrong_env, task, f"<answer>{wrong_d:.4f}</answer>")).info["cascade"]
    )
    assert right.values[1] == right.reward == 1.0  # the truth's own minimum
    assert right.values[0] > wrong.values[0] and right.values[1] > wrong.values[1]
    assert [s.cost_unit for s in right.stages] == [CostUnit.CPU_S, CostUnit.CPU_S]


@pytest.mark.slow
@needs_calculators
def test_the_contract_checker_passes():
    report = check_env(ENV_ID, seeds=1, cascade={"audit_probability": 0.5})
    assert report.passed, [c for c in report.checks if not c.passed]
    cascade = next(c for c in report.checks if c.name == "cascade")
    assert "failing stage 'dft' -> verifier_failed" in cascade.detail


async def test_the_learnt_baseline_sees_the_screen_and_the_stretch_against_experiment():
    """``baseline_inputs``: CHGNet's reward and d / d_exp - 1, which carries across molecules."""
    env = make(ENV_ID)
    task = env.make_task("test", 0)
    await env.reset(task)
    d_exp = MOLECULES[task.prompt["molecule"]].d_exp
    assert env.unwrapped.baseline_inputs(1.1 * d_exp, 0.7) == pytest.approx((0.7, 0.1))
