"""``sim/structure-search-v0``: find a low-energy crystal structure for a composition.

Multi-turn. The model is given a composition (e.g. ``Cu3Au``) and may call
two tools, at most ``tool_budget`` calls in all:

- ``energy(structure)``: total energy and energy per atom (eV) of the structure as given;
- ``relax(structure)``: relaxes positions and cell; returns the relaxed structure and its energy.

It ends the episode with ``<answer>{structure JSON}</answer>``. The answer
must have the composition's element ratio (``InvalidActionError``
otherwise); its energy per atom ``E`` is computed *as submitted* and
compared with the best known reference ``E_ref``: the lowest relaxed
energy per atom over the cubic prototypes of the composition (fcc / bcc
for elements, L1_2 for A3B, B2 for AB), computed with the same calculator::

    reward = 1                                  if E <= E_ref + 0.005 eV/atom
           = max(0, 1 - (E - E_ref - 0.005) / 0.2)   otherwise

Structures use the JSON of ``labrl.lab_adapters.structures``.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Sequence
from functools import reduce
from math import gcd
from typing import Any, ClassVar

from labrl.envs.actions import format_tool_call
from labrl.envs.base import Env
from labrl.envs.sim.common import Calculator, extract_answer, formula_of, prototype_atoms, split_of
from labrl.envs.sim.lattice import check_starting_radii, guess_lattice_constant
from labrl.envs.types import Action, Budgets, EnvSpec, Message, Observation, Split, StepResult, Task, ToolSpec
from labrl.errors import ConfigError, InvalidActionError
from labrl.lab_adapters.structures import parse_structure, structure_to_dict

ENV_ID = "sim/structure-search-v0"
SLACK_EV = 0.005
ZERO_AT_EV = 0.2
MAX_ATOMS = 8
STRUCTURE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "lattice": {"type": "array", "description": "3x3 cell rows (Å) or [a, b, c, alpha, beta, gamma]"},
        "species": {"type": "array", "items": {"type": "string"}},
        "frac_coords": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
    },
    "required": ["lattice", "species", "frac_coords"],
}


def _structure_tool(name: str, description: str) -> ToolSpec:
    """A calculator tool whose one argument is a structure (``STRUCTURE_SCHEMA``)."""
    parameters = {"type": "object", "properties": {"structure": STRUCTURE_SCHEMA}, "required": ["structure"]}
    return ToolSpec(name=name, description=description, parameters=parameters)


TOOLS = (
    _structure_tool("energy", "Total energy (eV) and energy per atom of a structure, as given."),
    _structure_tool("relax", "Relax atoms and cell; returns the relaxed structure and its energy."),
)
DEFAULT_ELEMENTS = ("Al", "Cu", "Ag", "Au", "Ni", "Pd", "Pt")


def reward_for(energy_per_atom: float, reference: float, zero_at_ev: float = ZERO_AT_EV) -> float:
    """1 within ``SLACK_EV`` eV/atom of ``reference``, falling linearly to 0 at ``zero_at_ev`` beyond it."""
    excess = energy_per_atom - reference
    if not math.isfinite(excess):
        return 0.0
    if excess <= SLACK_EV:
        return 1.0
    return max(0.0, 1.0 - (excess - SLACK_EV) / zero_at_ev)


def _ratio(species: Sequence[str]) -> tuple[tuple[str, int], ...]:
    counts = Counter(species)
    divisor = reduce(gcd, counts.values())
    return tuple(sorted((element, n // divisor) for element, n in counts.items()))


class StructureSearchEnv(Env):
    invalid_action_reward: ClassVar[float] = 0.0

    def __init__(
        self,
        backend: str = "emt",
        elements: Sequence[str] = DEFAULT_ELEMENTS,
        tool_budget: int = 4,
        remote_backend: str = "emt",
        lab_url: str | None = None,
        api_key_env: str = "LABRL_LAB_API_KEY",
    ) -> None:
        if tool_budget < 0:
            raise ConfigError(f"tool_budget must be >= 0, got {tool_budget}")
        self.calc = Calculator(
            backend, remote_backend=remote_backend, lab_url=lab_url, api_key_env=api_key_env
        )
        self.calc.check(set(elements), {"energy", "relax"})
        check_starting_radii(elements)
        self.tool_budget = tool_budget
        self.tasks: dict[str, list[tuple[str, str, tuple[str, ...]]]] = {"train": [], "test": []}
        compositions: list[tuple[str, tuple[str, ...]]] = [("A", (e,)) for e in elements]
        compositions += [("A3B", (a, b)) for a in elements for b in elements if a != b]
        compositions += [("AB", (a, b)) for a in elements for b in elements if a < b]
        for kind, elems in compositions:
            proto = {"A": "fcc", "A3B": "L1_2", "AB": "B2"}[kind]
            formula = formula_of(proto, elems)
            self.tasks[split_of(f"search-{formula}")].append((formula, kind, elems))
        self.spec = EnvSpec(
            id=ENV_ID,
            description="Propose a low-energy crystal structure for a composition; energy and relax tools.",
            budgets=Budgets(
                max_turns=tool_budget + 1, step_timeout_s=300, scoring_timeout_s=300, reset_timeout_s=300
            ),
            tools=TOOLS,
            tags=("simulator", "materials", "multi-turn", self.calc.calc_backend),
            has_gold_answer=True,
        )
        self._calls_left = 0

    def make_task(self, split: Split, seed: int) -> Task:
        items = self.tasks[split]
        formula, kind, elems = items[seed % len(items)]
        if kind == "A":
            species = [elems[0]] * 4
        elif kind == "A3B":
            species = [elems[0]] * 3 + [elems[1]]
        else:
            species = [elems[0], elems[1]]
        return Task(
            env_id=ENV_ID,
            split=split,
            seed=seed,
            task_id=f"search-{formula}",
            prompt={"formula": formula, "composition": dict(Counter(species)), "max_atoms": MAX_ATOMS},
            metadata={"kind": kind, "elements": list(elems)},
        )

    def _reference_prototypes(self, task: Task) -> list[tuple[str, tuple[str, ...]]]:
        elems = tuple(task.metadata["elements"])
        kind = task.metadata["kind"]
        return {"A": [("fcc", elems), ("bcc", elems)], "A3B": [("L1_2", elems)], "AB": [("B2", elems)]}[kind]

    async def reference(self, task: Task) -> tuple[float, dict[str, Any]]:
        """``(E_ref per atom, structure)``: the best relaxed prototype with this env's calculator."""
        best: tuple[float, dict[str, Any]] | None = None
        for proto, elems in self._reference_prototypes(task):
            a0 = guess_lattice_constant(proto, elems)
            start = structure_to_dict(prototype_atoms(proto, elems, a0))
            result = await self.calc.run("relax", start)
            if best is None or result["energy_per_atom_ev"] < best[0]:
                best = (float(result["energy_per_atom_ev"]), result["structure"])
        assert best is not None
        return best

    async def reset(self, task: Task) -> Observation:
        self._task = task
        self._calls_left = self.tool_budget
        text = (
            f"Find a low-energy crystal structure for {task.prompt['formula']} (at most {MAX_ATOMS} atoms per cell; "
            f"any multiple of the formula) as computed with the {self.calc.calc_backend} calculator. You may call "
            f"energy(structure) and relax(structure) up to {self.tool_budget} times in all, then answer "
            '<answer>{"lattice": [[...], [...], [...]], "species": [...], "frac_coords": [[...], ...]}</answer>. '
            "Your reward is set by the energy per atom of the structure you submit, as submitted."
        )
        return Observation(messages=(Message(role="user", content=text),), tools=TOOLS)

    def _structure(self, data: Any) -> dict[str, Any]:
        task = self.episode_task()
        atoms = parse_structure(data, max_atoms=MAX_ATOMS)
        want = _ratio([e for e, n in task.prompt["composition"].items() for _ in range(n)])
        got = _ratio(atoms.get_chemical_symbols())
        if got != want:
            raise InvalidActionError(
                f"structure composition {dict(got)} does not match {task.prompt['formula']} {dict(want)}"
            )
        return structure_to_dict(atoms, digits=10)

    async def step(self, action: Action) -> StepResult:
        task = self.episode_task()
        if action.parse_error:
            raise InvalidActionError(action.parse_error)
        if action.tool_calls:
            return await self._tools(action)
        structure = self._structure(extract_answer(action.text))
        reference, _ = await self.reference(task)
        result = await self.calc.run("energy", structure)
        energy = float(result["energy_per_atom_ev"])
        reward = await self.score(reward_for, energy, reference)
        return StepResult(
            reward=reward,
            done=True,
            info={"energy_per_atom_ev": energy, "reference_ev": reference, "excess_ev": energy - reference},
        )

    async def _tools(self, action: Action) -> StepResult:
        messages = []
        for call in action.tool_calls:
            if call.name not in ("energy", "relax"):
                raise InvalidActionError(f"unknown tool {call.name!r}; the tools are energy and relax")
            if self._calls_left <= 0:
                raise InvalidActionError(
                    f"the tool budget of {self.tool_budget} calls is spent: submit an <answer>"
                )
            self._calls_left -= 1
            structure = self._structure(call.arguments.get("structure"))
            result = await self.calc.run(call.name, structure)
            shown = {
                k: v
                for k, v in result.items()
                if k in ("energy_ev", "energy_per_atom_ev", "structure", "converged")
            }
            messages.append(
                Message(
                    role="tool",
                    name=call.name,
                    tool_call_id=call.id,
                    content=json.dumps(shown, sort_keys=True),
                )
            )
        info = {"tool_calls_left": self._calls_left}
        return StepResult(observation=Observation(messages=tuple(messages), tools=TOOLS), info=info)

    def gold_actions(self, task: Task) -> Sequence[Action] | None:
        return [Action(text=f"<answer>{json.dumps(_gold_structure(self, task))}</answer>")]

    def random_action(self, task: Task, rng: random.Random) -> Action:
        kind = task.metadata["kind"]
        elems = tuple(task.metadata["elements"])
        proto = rng.choice({"A": ["fcc", "bcc", "sc"], "A3B": ["L1_2"], "AB": ["B2"]}[kind])
        a0 = guess_lattice_constant(proto, elems) * rng.uniform(0.9, 1.1)
        structure = structure_to_dict(prototype_atoms(proto, elems, a0), digits=4)
        if rng.random() < 0.5:
            from labrl.envs.actions import parse_action

            return parse_action(format_tool_call(rng.choice(["energy", "relax"]), {"structure": structure}))
        return Action(text=f"<answer>{json.dumps(structure)}</answer>")


def _gold_structure(env: StructureSearchEnv, task: Task) -> dict[str, Any]:
    """The reference structure, relaxed synchronously in this process."""
    from labrl.lab_adapters.calculators import execute_calculation

    best: tuple[float, dict[str, Any]] | None = None
    for proto, elems in env._reference_prototypes(task):
        a0 = guess_lattice_constant(proto, elems)
        request = {
            "kind": "calculation",
            "backend": env.calc.calc_backend,
            "task": "relax",
            "structure": structure_to_dict(prototype_atoms(proto, elems, a0)),
        }
        result = execute_calculation(request)
        if best is None or result["energy_per_atom_ev"] < best[0]:
            best = (result["energy_per_atom_ev"], result["structure"])
    assert best is not None
    return best[1]
