"""Simulator envs: bad structures and answers are invalid_action, bad configs fail at creation."""

from __future__ import annotations

import json
import math
import re

import pytest

from labrl.envs.actions import format_tool_call, parse_action
from labrl.envs.checker import check_env
from labrl.envs.registry import make
from labrl.envs.sim.lattice import reward_for
from labrl.envs.types import Action, Outcome
from labrl.errors import ConfigError, InvalidActionError
from labrl.lab_adapters.structures import parse_structure, structure_hash

FCC_CU = {
    "lattice": [[3.6, 0, 0], [0, 3.6, 0], [0, 0, 3.6]],
    "species": ["Cu"] * 4,
    "frac_coords": [[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]],
}


@pytest.mark.parametrize(
    ("structure", "message"),
    [
        ({**FCC_CU, "species": ["Cu", "Cu", "Cu", "Xx"]}, "unknown element(s) Xx"),
        (
            {**FCC_CU, "frac_coords": [[0, 0, 0], [0.01, 0, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]]},
            "atoms overlap: two atoms are 0.036 Å apart (minimum 0.7 Å)",
        ),
        (
            {**FCC_CU, "lattice": [[300, 0, 0], [0, 300, 0], [0, 0, 300]]},
            "cell volume is 6.75e+06 Å^3 per atom",
        ),
        (
            {**FCC_CU, "lattice": [[3.6, 0, 0], [0, 3.6, 0], [0, 0, float("nan")]]},
            '"lattice" contains a non-finite number',
        ),
        (
            {**FCC_CU, "frac_coords": [[0, 0, 0]]},
            '"frac_coords" must be 4 rows of 3 numbers (one per species), got shape [1, 3]',
        ),
        ({"species": ["Cu"]}, "structure is missing 'lattice', 'frac_coords'"),
    ],
)
def test_bad_structures_refused_with_a_message(structure, message):
    with pytest.raises(InvalidActionError, match=re.escape(message)):
        parse_structure(structure)


def test_structure_hash_ignores_atom_order_and_wrapping():
    shuffled = {**FCC_CU, "frac_coords": [[0, 0.5, 0.5], [1.0, 0, 0], [0.5, 0, 0.5], [0.5, 0.5, 0]]}
    assert structure_hash(parse_structure(FCC_CU)) == structure_hash(parse_structure(shuffled))
    stretched = {**FCC_CU, "lattice": [[3.61, 0, 0], [0, 3.6, 0], [0, 0, 3.6]]}
    assert structure_hash(parse_structure(FCC_CU)) != structure_hash(parse_structure(stretched))


def test_lattice_reward_formula():
    assert reward_for(0.005) == 1.0
    assert reward_for(0.0525) == pytest.approx(0.5)
    assert reward_for(0.2) == 0.0
    assert reward_for(math.nan) == 0.0


def test_unsupported_elements_fail_at_creation():
    with pytest.raises(
        ConfigError, match=re.escape("calculator backend 'emt' does not support element(s) Fe")
    ):
        make("sim/lattice-constant-v0", elements=["Cu", "Fe"])
    with pytest.raises(
        ConfigError, match=re.escape("calculator backend 'pyscf' does not support element(s) Cu")
    ):
        make("sim/lattice-constant-v0", backend="pyscf", elements=["Cu"])
    with pytest.raises(ConfigError, match=re.escape("calculator backend 'pyscf' cannot do relax")):
        make("sim/structure-search-v0", backend="pyscf", elements=["Li"])
    with pytest.raises(ConfigError, match=re.escape('backend="remote" needs lab_url')):
        make("sim/lattice-constant-v0", backend="remote")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("3.6", "no <answer>...</answer> block found"),
        ("<answer>big</answer>", "the answer must be one number in Å, got 'big'"),
        ("<answer>-3</answer>", "the lattice constant must be a positive finite number, got -3.0"),
        ("<answer>0</answer>", "the lattice constant must be a positive finite number, got 0.0"),
        ("<answer>40</answer>", "a = 40 Å puts nearest neighbours 28.28 Å apart"),
        ("<answer>1e308</answer>", "puts nearest neighbours"),
    ],
)
async def test_lattice_bad_answers_are_invalid_action(text, message):
    env = make("sim/lattice-constant-v0")
    task = env.make_task("train", 0)
    assert task.prompt["prototype"] == "fcc"
    await env.reset(task)
    result = await env.step(parse_action(text))
    await env.close()
    assert result.outcome is Outcome.INVALID_ACTION and result.reward == 0.0
    assert message in result.observation.messages[0].content


async def test_lattice_reward_from_relaxation():
    env = make("sim/lattice-constant-v0")
    task = env.make_task("train", 0)
    gold = env.gold_actions(task)[0]
    a_gold = float(re.search(r"<answer>(.*)</answer>", gold.text).group(1))
    await env.reset(task)
    result = await env.step(Action(text=f"<answer>{a_gold * 1.0525:.6f}</answer>"))
    await env.close()
    assert result.outcome is Outcome.OK
    assert result.info["a_relaxed"] == pytest.approx(a_gold, rel=1e-4)
    assert result.reward == pytest.approx(0.5, abs=0.01)  # 5.25 % off -> halfway down the linear ramp


async def test_structure_search_tools_and_bad_structures():
    env = make("sim/structure-search-v0", tool_budget=1)
    task = env.make_task("train", 0)
    await env.reset(task)
    species = task.prompt["composition"]
    element = next(iter(species))
    structure = {**FCC_CU, "species": [element] * 4, "lattice": [[4.0, 0, 0], [0, 4.0, 0], [0, 0, 4.0]]}
    result = await env.step(parse_action(format_tool_call("relax", {"structure": structure})))
    assert result.outcome is Outcome.OK and not result.done
    relaxed = json.loads(result.observation.messages[0].content)
    assert relaxed["converged"] and math.isfinite(relaxed["energy_per_atom_ev"])
    overlapping = {**structure, "frac_coords": [[0, 0, 0], [0, 0, 0.001], [0.5, 0, 0.5], [0, 0.5, 0.5]]}
    bad = await env.step(Action(text=f"<answer>{json.dumps(overlapping)}</answer>"))
    assert bad.outcome is Outcome.INVALID_ACTION and "atoms overlap" in bad.observation.messages[0].content
    assert bad.reward == 0.0 and bad.done  # the last turn: the episode ends on the invalid action
    await env.close()


def test_lattice_env_passes_the_checker():
    report = check_env("sim/lattice-constant-v0", seeds=4)
    assert report.passed, [c for c in report.checks if not c.passed]


@pytest.mark.slow
def test_structure_search_env_passes_the_checker():
    report = check_env("sim/structure-search-v0", seeds=4)
    assert report.passed, [c for c in report.checks if not c.passed]
