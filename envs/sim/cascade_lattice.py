"""``materials/cascade-chgnet-pyscf-v0``: a lattice constant scored by CHGNet, audited by DFT.

The model is told a light crystal (``cascade_references.MATERIALS``: C and Si train, BN and
MgO test; two-atom primitive cells, the cheapest for PySCF) and answers its equilibrium cubic
constant, ``<answer>4.03</answer>`` (Å, rounded to 1e-4). Each stage scores the answer by the energy per
atom of the crystal at that constant above the stage's own reference (``search.reward_for``)::

    dE_c(a) = E_c(a) / n - E_ref_c                      (eV/atom, c = chgnet or pyscf)
    r_c(a)  = 1                                         if dE_c <= 0.005
            = max(0, 1 - (dE_c - 0.005) / 0.2)          otherwise

Stage ``chgnet`` (the screen: the CHGNet potential in the process pool, ``cpu_s``) passes the
candidate on to stage ``dft`` (the truth: a PySCF LDA single point at the Gamma point in a
killable subprocess, ``cpu_s``) when ``r_chgnet >= pass_threshold`` (or, with ``top_k``, when it
is among the group's ``top_k`` by ``r_chgnet``); others reach DFT with the run's
``cascade.audit_probability``. CHGNet (fitted to PBE) and Gamma-point LDA put the minimum at
different constants, so the screen is a biased proxy of the truth: the reward is the cascade
estimator's (``labrl.envs.cascade``), unbiased for ``r_pyscf``. The references ``E_ref_c`` and the
gold constant (PySCF's ``a*``) come from ``data/cascade_references.json``; the default stage costs
and latencies are the medians measured while making it.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from labrl.envs.cascade.env import CascadeEnv
from labrl.envs.cascade.stages import CostUnit, Latency, Stage, Threshold, TopK
from labrl.envs.sim.cascade_references import ANSWER_DIGITS, MATERIALS, crystal_structure, load_references
from labrl.envs.sim.common import Calculator, extract_answer, parse_angstrom
from labrl.envs.sim.search import reward_for
from labrl.envs.types import Action, Budgets, EnvSpec, Message, Observation, Split, Task
from labrl.errors import ConfigError, EnvError, InvalidActionError

ENV_ID = "materials/cascade-chgnet-pyscf-v0"
#: stage name -> calculator backend
STAGE_BACKENDS = {"chgnet": "chgnet", "dft": "pyscf"}
#: an answer outside [0.8, 1.25] x the experimental constant is no plausible prediction (the window
#: of the calculators' own lattice relaxation); refusing it also keeps DFT off absurd cells
PLAUSIBLE = (0.8, 1.25)


class LatticeCascadeOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    materials: tuple[str, ...] = Field(
        default=tuple(MATERIALS), min_length=2, description="a subset of the catalogue (both splits)"
    )
    pass_threshold: float = Field(default=0.5, description="CHGNet reward that passes a candidate on")
    top_k: int | None = Field(default=None, ge=1, description="pass the top k of the group instead")
    chgnet_cost_cpu_s: float | None = Field(default=None, ge=0, description="None: the measured median")
    dft_cost_cpu_s: float | None = Field(default=None, ge=0, description="None: the measured median")
    dft_timeout_s: float = Field(default=600.0, gt=0, le=3600, description="PySCF is killed after this")
    cascade: dict[str, Any] | None = Field(default=None, description="the run's cascade: section")

    @model_validator(mode="after")
    def _known_materials(self) -> LatticeCascadeOptions:
        unknown = sorted(set(self.materials) - set(MATERIALS))
        if unknown:
            raise ValueError(f"unknown material(s) {unknown}; choose from {list(MATERIALS)}")
        splits = {MATERIALS[m].split for m in self.materials}
        if splits != {"train", "test"}:
            raise ValueError(f"materials {list(self.materials)} leave a split empty (splits: {MATERIALS})")
        return self


def measured_stage(name: str, cost: float | None, calls: Sequence[float], pass_on: Any = None) -> Stage:
    """A ``cpu_s`` stage whose cost (unless given) and latency are the measured CPU-seconds per call:
    cost and median the median of ``calls``, sigma the standard deviation of their logarithms."""
    logs = [math.log(max(s, 1e-3)) for s in calls]
    median = statistics.median(calls)
    return Stage(
        name=name,
        cost_unit=CostUnit.CPU_S,
        cost=round(median, 3) if cost is None else cost,
        latency=Latency(median_s=max(median, 1e-3), sigma=min(statistics.pstdev(logs), 5.0)),
        pass_on=pass_on,
    )


class LatticeCascadeEnv(CascadeEnv):
    """See the module docstring."""

    options_model = LatticeCascadeOptions
    invalid_action_reward: ClassVar[float] = 0.0

    def __init__(self, **options: Any) -> None:
        try:
            self.options = LatticeCascadeOptions.model_validate(options)
        except ValidationError as exc:
            detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"{ENV_ID}: invalid option(s): {detail}") from None
        super().__init__(self.options.cascade)
        o = self.options
        elements = {e for m in o.materials for e in crystal_structure(m, MATERIALS[m].a_exp)["species"]}
        self.calculators = {
            "chgnet": Calculator("chgnet", timeout_s=120.0),
            "dft": Calculator("pyscf", timeout_s=o.dft_timeout_s),
        }
        for calculator in self.calculators.values():
            calculator.check(elements, {"energy"})  # a missing extra fails here, not mid-run
        self.references = load_references()
        measured = {
            stage: [s for m in o.materials for s in self.references[m][backend]["cpu_s_per_call"]]
            for stage, backend in STAGE_BACKENDS.items()
        }
        rule = TopK(k=o.top_k) if o.top_k else Threshold(min_reward=o.pass_threshold)
        self.set_stages(
            (
                measured_stage("chgnet", o.chgnet_cost_cpu_s, measured["chgnet"], pass_on=rule),
                measured_stage("dft", o.dft_cost_cpu_s, measured["dft"]),
            ),
            ENV_ID,
        )
        self.tasks = {
            split: [m for m in o.materials if MATERIALS[m].split == split] for split in ("train", "test")
        }
        # the first CHGNet call of a worker loads the model: a minute covers it on a loaded machine
        scoring = o.dft_timeout_s + 60.0
        self.spec = EnvSpec(
            id=ENV_ID,
            description="Predict a light crystal's lattice constant (Å); CHGNet screens, PySCF DFT audits.",
            budgets=Budgets(
                max_turns=1, reset_timeout_s=10, scoring_timeout_s=scoring, step_timeout_s=2 * scoring
            ),
            tags=("simulator", "materials", "cascade", "chgnet", "pyscf"),
            has_gold_answer=True,
        )

    def make_task(self, split: Split, seed: int) -> Task:
        items = self.tasks[split]
        material = items[seed % len(items)]
        m = MATERIALS[material]
        return Task(
            env_id=ENV_ID,
            split=split,
            seed=seed,
            task_id=f"{split}-{material}",
            prompt={"material": material, "formula": m.formula, "structure": m.structure},
            answer=self.references[material]["pyscf"]["a"],
        )

    async def reset(self, task: Task) -> Observation:
        self._task = task
        p = task.prompt
        text = (
            f"Predict the equilibrium cubic lattice constant a (in Å) of {p['formula']} in the "
            f"{p['structure']} structure, as computed with LDA density functional theory (PySCF, "
            "gth-szv basis, GTH pseudopotentials, Gamma point only). Answer with the number inside "
            "<answer></answer>, e.g. <answer>4.03</answer>."
        )
        return Observation(messages=(Message(role="user", content=text),))

    def candidate(self, action: Action) -> float:
        a = round(parse_angstrom(extract_answer(action.text)), ANSWER_DIGITS)
        m = MATERIALS[self.episode_task().prompt["material"]]
        lo, hi = (f * m.a_exp for f in PLAUSIBLE)
        if not lo <= a <= hi:
            raise InvalidActionError(
                f"a = {a:g} Å is no plausible lattice constant for {m.formula} ({m.structure}): "
                f"answer between {lo:.2f} and {hi:.2f} Å"
            )
        return a

    def candidate_text(self, candidate: float) -> str:
        return f"{candidate:.{ANSWER_DIGITS}f}"

    async def evaluate(self, stage: Stage, candidate: float) -> float:
        material = self.episode_task().prompt["material"]
        result = await self.calculators[stage.name].run("energy", crystal_structure(material, candidate))
        reference = self.references[material][STAGE_BACKENDS[stage.name]]["e_ref_per_atom_ev"]
        energy = float(result["energy_per_atom_ev"])
        if not math.isfinite(energy):
            raise EnvError(f"{stage.name}: non-finite energy {energy}")
        return reward_for(energy, reference)

    def gold_actions(self, task: Task) -> Sequence[Action] | None:
        return [Action(text=f"<answer>{float(task.answer):.{ANSWER_DIGITS}f}</answer>")]

    def random_action(self, task: Task, rng: random.Random) -> Action:
        a = MATERIALS[task.prompt["material"]].a_exp * rng.uniform(0.92, 1.08)
        return Action(text=f"<answer>{a:.3f}</answer>")
