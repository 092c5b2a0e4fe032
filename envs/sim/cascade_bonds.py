"""``materials/cascade-chgnet-pyscf-v0``: a bond length scored by CHGNet, audited by DFT.

The model is told a diatomic molecule of light elements (``cascade_references.MOLECULES``: N2
and CO train, HF test; in a periodic 4 Å box) and answers its equilibrium bond length,
``<answer>1.10</answer>`` (Å, rounded to 1e-4). Each stage scores the answer by the energy per
atom of the molecule at that bond length above the stage's own reference (``search.reward_for``)::

    dE_c(d) = E_c(d) / n - E_ref_c                      (eV/atom, c = chgnet or pyscf)
    r_c(d)  = 1                                         if dE_c <= 0.005
            = max(0, 1 - (dE_c - 0.005) / 2.0)          otherwise

Stage ``chgnet`` (the screen: the CHGNet potential in the process pool, ``cpu_s``) passes the
candidate on to stage ``dft`` (the truth: a PySCF LDA single point in a killable subprocess,
``cpu_s``) when ``r_chgnet >= pass_threshold`` (or, with ``top_k``, when it is among the group's
``top_k`` by ``r_chgnet``); others reach DFT with the run's ``cascade.audit_probability``. CHGNet
(fitted to PBE energies of crystals) and LDA in a minimal basis put the minimum at different bond
lengths, so the screen is a biased proxy of the truth: the reward is the cascade estimator's
(``labrl.envs.cascade``), unbiased for ``r_pyscf``. The references ``E_ref_c`` and the gold bond
length (PySCF's ``d*``) come from ``data/cascade_references.json``; the default stage costs and
latencies are the medians measured while making it.
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
from labrl.envs.sim.cascade_references import (
    ANSWER_DIGITS,
    BOX_A,
    MOLECULES,
    SEARCH_WINDOW,
    load_references,
    molecule_structure,
)
from labrl.envs.sim.common import Calculator, extract_answer, parse_angstrom
from labrl.envs.sim.search import reward_for
from labrl.envs.types import Action, Budgets, EnvSpec, Message, Observation, Split, Task
from labrl.errors import ConfigError, EnvError, InvalidActionError

ENV_ID = "materials/cascade-chgnet-pyscf-v0"
#: stage name -> calculator backend
STAGE_BACKENDS = {"chgnet": "chgnet", "dft": "pyscf"}
#: eV/atom above the reference at which a stage's reward reaches 0. Stretching a bond across the
#: plausible window costs eV per atom; at the crystals' 0.2 (structure search) each calculator
#: would give the other's optimum no reward at all, and the screen would carry no signal
ZERO_AT_EV = 2.0


class BondCascadeOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    molecules: tuple[str, ...] = Field(
        default=tuple(MOLECULES), min_length=2, description="a subset of the catalogue (both splits)"
    )
    pass_threshold: float = Field(default=0.5, description="CHGNet reward that passes a candidate on")
    top_k: int | None = Field(default=None, ge=1, description="pass the top k of the group instead")
    chgnet_cost_cpu_s: float | None = Field(default=None, ge=0, description="None: the measured median")
    dft_cost_cpu_s: float | None = Field(default=None, ge=0, description="None: the measured median")
    dft_timeout_s: float = Field(default=600.0, gt=0, le=3600, description="PySCF is killed after this")
    cascade: dict[str, Any] | None = Field(default=None, description="the run's cascade: section")

    @model_validator(mode="after")
    def _known_molecules(self) -> BondCascadeOptions:
        unknown = sorted(set(self.molecules) - set(MOLECULES))
        if unknown:
            raise ValueError(f"unknown molecule(s) {unknown}; choose from {list(MOLECULES)}")
        splits = {m: MOLECULES[m].split for m in self.molecules}
        if set(splits.values()) != {"train", "test"}:
            raise ValueError(f"molecules {list(self.molecules)} leave a split empty (their splits: {splits})")
        return self


def measured_stage(
    name: str, cost: float | None, calls: Sequence[float], pass_on: Threshold | TopK | None = None
) -> Stage:
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


class BondCascadeEnv(CascadeEnv):
    """See the module docstring."""

    options_model = BondCascadeOptions
    invalid_action_reward: ClassVar[float] = 0.0

    def __init__(self, **options: Any) -> None:
        try:
            self.options = BondCascadeOptions.model_validate(options)
        except ValidationError as exc:
            detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"{ENV_ID}: invalid option(s): {detail}") from None
        super().__init__(self.options.cascade)
        o = self.options
        elements = {e for m in o.molecules for e in MOLECULES[m].atoms}
        self.calculators = {
            "chgnet": Calculator("chgnet", timeout_s=120.0),
            "dft": Calculator("pyscf", timeout_s=o.dft_timeout_s),
        }
        for calculator in self.calculators.values():
            calculator.check(elements, {"energy"})  # a missing extra fails here, not mid-run
        self.references = load_references()
        measured = {
            stage: [s for m in o.molecules for s in self.references[m][backend]["cpu_s_per_call"]]
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
            split: [m for m in o.molecules if MOLECULES[m].split == split] for split in ("train", "test")
        }
        # the first CHGNet call of a worker loads the model: a minute covers it on a loaded machine
        scoring = o.dft_timeout_s + 60.0
        self.spec = EnvSpec(
            id=ENV_ID,
            description="Predict a small molecule's bond length (Å); CHGNet screens, PySCF DFT audits.",
            budgets=Budgets(
                max_turns=1, reset_timeout_s=10, scoring_timeout_s=scoring, step_timeout_s=2 * scoring
            ),
            tags=("simulator", "materials", "cascade", "chgnet", "pyscf"),
            has_gold_answer=True,
        )

    def make_task(self, split: Split, seed: int) -> Task:
        items = self.tasks[split]
        molecule = items[seed % len(items)]
        return Task(
            env_id=ENV_ID,
            split=split,
            seed=seed,
            task_id=f"{split}-{molecule}",
            prompt={"molecule": molecule},
            answer=self.references[molecule]["pyscf"]["d"],
        )

    async def reset(self, task: Task) -> Observation:
        self._task = task
        text = (
            f"Predict the equilibrium bond length d (in Å) of the {task.prompt['molecule']} molecule, "
            "as computed with LDA density functional theory (PySCF, gth-szv basis, GTH "
            f"pseudopotentials) in a periodic cubic box of {BOX_A:g} Å. Answer with the number "
            "inside <answer></answer>, e.g. <answer>1.10</answer>."
        )
        return Observation(messages=(Message(role="user", content=text),))

    def candidate(self, action: Action) -> float:
        d = round(parse_angstrom(extract_answer(action.text), "the bond length"), ANSWER_DIGITS)
        molecule = self.episode_task().prompt["molecule"]
        lo, hi = (f * MOLECULES[molecule].d_exp for f in SEARCH_WINDOW)
        if not lo <= d <= hi:  # also keeps DFT off absurd geometries
            raise InvalidActionError(
                f"d = {d:g} Å is no plausible bond length for {molecule}: answer between {lo:.2f} and {hi:.2f} Å"
            )
        return d

    def candidate_text(self, candidate: float) -> str:
        return f"{candidate:.{ANSWER_DIGITS}f}"

    def baseline_inputs(self, candidate: float, first_value: float) -> tuple[float, ...]:
        # CHGNet's reward and the bond stretched against experiment: where LDA's minimum sits is
        # similar across these molecules (d*_PySCF / d_exp = 1.27-1.29), so it carries to HF
        return (first_value, candidate / MOLECULES[self.episode_task().prompt["molecule"]].d_exp - 1.0)

    async def evaluate(self, stage: Stage, candidate: float) -> float:
        molecule = self.episode_task().prompt["molecule"]
        result = await self.calculators[stage.name].run("energy", molecule_structure(molecule, candidate))
        reference = self.references[molecule][STAGE_BACKENDS[stage.name]]["e_ref_per_atom_ev"]
        energy = float(result["energy_per_atom_ev"])
        if not math.isfinite(energy):
            raise EnvError(f"{stage.name}: non-finite energy {energy}")
        return reward_for(energy, reference, zero_at_ev=ZERO_AT_EV)

    def gold_actions(self, task: Task) -> Sequence[Action] | None:
        return [Action(text=f"<answer>{float(task.answer):.{ANSWER_DIGITS}f}</answer>")]

    def random_action(self, task: Task, rng: random.Random) -> Action:
        d = MOLECULES[task.prompt["molecule"]].d_exp * rng.uniform(0.9, 1.15)
        return Action(text=f"<answer>{d:.3f}</answer>")
