"""``sim/lattice-constant-v0``: predict the equilibrium lattice constant of a cubic crystal.

The model is told a prototype (fcc, bcc, L1_2 A3B, B2 AB) and its elements
and answers ``<answer>3.615</answer>`` (Å). The answer is verified by
relaxing the crystal with the env's calculator starting *from the
prediction* (``calculators.relax_lattice``: the fractional coordinates are
fixed by symmetry, so this is a 1-D minimisation of E(a)); no stored answer
is consulted. With ``e = |a_pred - a_relaxed| / a_relaxed``::

    reward = 1                                  if e <= 0.005
           = max(0, 1 - (e - 0.005) / 0.095)    otherwise   (0 at 10 % off)

Predictions whose nearest-neighbour distance falls outside 1.5-4.5 Å are
absurd (no metal has such bonds) and answered ``invalid_action``, as are
answers that are not a positive finite number.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from typing import ClassVar

from labrl.envs.base import Env
from labrl.envs.sim.common import (
    Calculator,
    extract_answer,
    formula_of,
    parse_angstrom,
    prototype_atoms,
    split_of,
)
from labrl.envs.types import Action, Budgets, EnvSpec, Message, Observation, Split, StepResult, Task
from labrl.errors import ConfigError, EnvError, InvalidActionError
from labrl.lab_adapters.structures import structure_to_dict

ENV_ID = "sim/lattice-constant-v0"
TOLERANCE = 0.005
ZERO_AT = 0.10
NN_RANGE = (1.5, 4.5)  # Å
#: nearest-neighbour distance / a for each prototype (used for the sanity check and the start guess)
NN_OVER_A = {
    "fcc": 1 / math.sqrt(2),
    "bcc": math.sqrt(3) / 2,
    "sc": 1.0,
    "L1_2": 1 / math.sqrt(2),
    "B2": math.sqrt(3) / 2,
}
#: rough metallic radii (Å) for the starting guess of the reference relaxation
_RADII = {
    "Al": 1.43,
    "Cu": 1.28,
    "Ag": 1.44,
    "Au": 1.44,
    "Ni": 1.24,
    "Pd": 1.37,
    "Pt": 1.39,
    "Li": 1.52,
    "Na": 1.86,
    "Mg": 1.60,
    "Si": 1.17,
    "C": 0.77,
    "Be": 1.12,
    "B": 0.9,
}
DEFAULT_ELEMENTS = ("Al", "Cu", "Ag", "Au", "Ni", "Pd", "Pt")


def reward_for(relative_error: float) -> float:
    if not math.isfinite(relative_error):
        return 0.0
    if relative_error <= TOLERANCE:
        return 1.0
    return max(0.0, 1.0 - (relative_error - TOLERANCE) / (ZERO_AT - TOLERANCE))


def _catalogue(elements: Sequence[str], prototypes: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    items: list[tuple[str, tuple[str, ...]]] = []
    for proto in prototypes:
        if proto in ("fcc", "bcc", "sc"):
            items += [(proto, (e,)) for e in elements]
        else:
            items += [(proto, pair) for pair in itertools.permutations(elements, 2)]
    return items


def guess_lattice_constant(prototype: str, elements: Sequence[str]) -> float:
    """Starting cubic lattice constant (Å): a = 2 * mean(radius) / (nearest-neighbour distance / a)."""
    return 2 * sum(_RADII[e] for e in elements) / len(elements) / NN_OVER_A[prototype]


def check_starting_radii(elements: Sequence[str]) -> None:
    """Every element needs a metallic radius (``_RADII``) for the starting lattice guess."""
    missing_radius = sorted(set(elements) - set(_RADII))
    if missing_radius:
        raise ConfigError(f"no starting radius for element(s) {missing_radius}; supported: {sorted(_RADII)}")


class LatticeConstantEnv(Env):
    invalid_action_reward: ClassVar[float] = 0.0

    def __init__(
        self,
        backend: str = "emt",
        elements: Sequence[str] = DEFAULT_ELEMENTS,
        prototypes: Sequence[str] = ("fcc", "bcc", "L1_2", "B2"),
        remote_backend: str = "emt",
        lab_url: str | None = None,
        api_key_env: str = "LABRL_LAB_API_KEY",
    ) -> None:
        unknown = sorted(set(prototypes) - set(NN_OVER_A))
        if unknown:
            raise ConfigError(f"unknown prototype(s) {unknown}; choose from {sorted(NN_OVER_A)}")
        if not elements:
            raise ConfigError("elements must name at least one element")
        self.calc = Calculator(
            backend, remote_backend=remote_backend, lab_url=lab_url, api_key_env=api_key_env
        )
        self.calc.check(set(elements), {"lattice"})  # unsupported elements fail here, not mid-run
        check_starting_radii(elements)
        self.tasks: dict[str, list[tuple[str, str, tuple[str, ...]]]] = {
            split: [] for split in ("train", "test")
        }
        for proto, elems in _catalogue(elements, prototypes):
            task_id = f"{proto}-{'-'.join(elems)}"
            self.tasks[split_of(task_id)].append((task_id, proto, elems))
        for split, items in self.tasks.items():
            if not items:
                raise ConfigError(
                    f"the element/prototype choice leaves the {split} split empty: add elements"
                )
        timeout = 1800.0 if self.calc.calc_backend == "pyscf" else 120.0
        self.spec = EnvSpec(
            id=ENV_ID,
            description="Predict the equilibrium cubic lattice constant (Å); verified by relaxing with the calculator.",
            budgets=Budgets(
                max_turns=1, step_timeout_s=timeout, scoring_timeout_s=timeout, reset_timeout_s=30
            ),
            tags=("simulator", "materials", self.calc.calc_backend),
            has_gold_answer=True,
        )

    def make_task(self, split: Split, seed: int) -> Task:
        items = self.tasks[split]
        task_id, proto, elems = items[seed % len(items)]
        a_guess = guess_lattice_constant(proto, elems)
        return Task(
            env_id=ENV_ID,
            split=split,
            seed=seed,
            task_id=task_id,
            prompt={"prototype": proto, "elements": list(elems), "formula": formula_of(proto, elems)},
            metadata={"a_guess": round(a_guess, 4), "backend": self.calc.backend},
        )

    async def reset(self, task: Task) -> Observation:
        self._task = task
        p = task.prompt
        text = (
            f"Predict the equilibrium lattice constant a (in Å) of {p['formula']} in the cubic {p['prototype']} "
            f"structure ({', '.join(p['elements'])}) as computed with the {self.calc.calc_backend} calculator. "
            "Answer with the number inside <answer></answer>, e.g. <answer>3.61</answer>."
        )
        return Observation(messages=(Message(role="user", content=text),))

    def _parse(self, text: str) -> float:
        a = parse_angstrom(extract_answer(text))
        task = self.episode_task()
        nn = a * NN_OVER_A[task.prompt["prototype"]]
        if not NN_RANGE[0] <= nn <= NN_RANGE[1]:
            raise InvalidActionError(
                f"a = {a:g} Å puts nearest neighbours {nn:.2f} Å apart; metallic bonds are {NN_RANGE[0]}-{NN_RANGE[1]} Å"
            )
        return a

    async def relaxed_constant(self, task: Task, a_start: float) -> float:
        atoms = prototype_atoms(task.prompt["prototype"], tuple(task.prompt["elements"]), a_start)
        result = await self.calc.run("lattice", structure_to_dict(atoms, digits=10), a=a_start)
        a = float(result["a"])
        if not math.isfinite(a) or a <= 0:
            raise EnvError(f"the calculator relaxed to a non-physical lattice constant {a}")
        return a

    async def step(self, action: Action) -> StepResult:
        task = self.episode_task()
        a_pred = self._parse(action.text)
        a_relaxed = await self.relaxed_constant(task, a_pred)
        error = abs(a_pred - a_relaxed) / a_relaxed
        reward = await self.score(reward_for, error)
        return StepResult(
            reward=reward,
            done=True,
            info={"a_pred": a_pred, "a_relaxed": a_relaxed, "relative_error": error},
        )

    def gold_actions(self, task: Task) -> Sequence[Action] | None:
        return [Action(text=f"<answer>{_gold_constant(self, task):.5f}</answer>")]

    def random_action(self, task: Task, rng: random.Random) -> Action:
        guess = task.metadata["a_guess"] * rng.uniform(0.85, 1.15)
        return Action(text=f"<answer>{guess:.3f}</answer>")


def _gold_constant(env: LatticeConstantEnv, task: Task) -> float:
    """The calculator's own lattice constant, relaxed from the radius-based guess (synchronously)."""
    from labrl.lab_adapters.calculators import relax_lattice

    guess = float(task.metadata["a_guess"])
    atoms = prototype_atoms(task.prompt["prototype"], tuple(task.prompt["elements"]), guess)
    a_star, _energy = relax_lattice(env.calc.calc_backend, atoms, guess)
    return a_star
