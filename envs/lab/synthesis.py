"""``lab/synthesis-v0`` and ``lab/synthesis-multiturn-v0``: make a target phase in a (simulated) lab.

The model is given a target phase (formula and space group) and writes a
solid-state synthesis recipe as JSON::

    <answer>{"precursors": [{"formula": "CaCO3", "mmol": 10}, {"formula": "TiO2", "mmol": 10}],
             "temperature_c": 1200, "time_h": 16, "atmosphere": "air"}</answer>

The recipe runs as a ``synthesis`` job on a lab through ``RestLabAdapter`` and
a ``JournaledLab`` (``labrl.envs.lab.session``): by default the mock lab
in-process, or a real lab with ``lab_url=`` (key in ``$LABRL_LAB_API_KEY`` or
the variable named by ``api_key_env``). The lab returns an XRD pattern, never
the phases it made. The journal (``journal_path``) must be a labrl journal or
absent: an empty or corrupt file stops the env with ``LabJournalError``
unless ``fresh_journal=True`` (the bad file is kept beside the new one).

Scoring is label-free, as an autonomous lab scores its own runs: the pattern
is fitted (``labrl.verifiers.xrd.fit``) with the target plus the plausible
phases of the recipe's chemical system (``recipes.candidate_phases``); the
target's fitted weight fraction ``f`` (0 when the fit finds the target
superfluous) gives::

    reward = min(1, f / 0.95)

so a recipe that makes the target at >= 95 wt % (what the gold recipes do)
earns the full 1.0.

Multi-turn variant (``max_experiments`` > 1): after each experiment the model
sees the pattern's strongest peaks and the lab's phase analysis and may
revise the recipe; the episode ends when a recipe reaches full reward or the
experiment budget is spent. Each step's reward is the improvement of the best
score so far, so the episode's summed reward is ``min(1, best f / 0.95)``.

Malformed JSON, unknown elements or precursors, absurd temperatures or times
and unknown atmospheres are ``invalid_action`` with a message (no experiment
is run and none is charged). A job the lab ran but that failed (e.g. every
precursor evaporated) is an experiment with ``f = 0``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any, ClassVar

from labrl.envs.base import Env
from labrl.envs.lab.session import LabSettings, check_settings, connection
from labrl.envs.lab_errors import lab_errors_as_env_errors
from labrl.envs.types import Action, Budgets, EnvSpec, Message, Observation, Split, StepResult, Task
from labrl.errors import ConfigError, EnvError, InvalidActionError
from labrl.lab_adapters import recipes
from labrl.lab_adapters.protocol import JobState, request_hash

FULL_REWARD_FRACTION = 0.95
PEAKS_SHOWN = 12
FORMAT = (
    '<answer>{"precursors": [{"formula": "...", "mmol": 10}, ...], "temperature_c": 900, '
    '"time_h": 12, "atmosphere": "air"}</answer>'
)


def reward_for(fraction: float) -> float:
    """``min(1, f / 0.95)``, clipped at 0."""
    return max(0.0, min(1.0, fraction / FULL_REWARD_FRACTION))


def analyse(xrd: dict[str, Any], target: str, candidates: list[str]) -> dict[str, Any]:
    """The lab's label-free analysis of one pattern (module-level: runs in the process pool)."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    from labrl.verifiers.xrd.fit import fit_phase_ids
    from labrl.verifiers.xrd.peaks import pick_peaks
    from labrl.verifiers.xrd.profile import Instrument

    counts = np.asarray(xrd["counts"], dtype=float)  # (n,)
    grid = xrd["two_theta_min"] + xrd["step"] * np.arange(len(counts))  # (n,)
    with threadpool_limits(limits=1, user_api="blas"):  # small solves: BLAS threads only spin
        fit = fit_phase_ids(grid, counts, candidates, Instrument.model_validate(xrd["instrument"]))
    detected = {
        pid: round(w, 4)
        for pid, w in sorted(fit.weight_fractions.items(), key=lambda kv: -kv[1])
        if pid not in fit.superfluous and w >= 0.005
    }
    fraction = 0.0 if target in fit.superfluous else float(fit.weight_fractions.get(target, 0.0))
    peaks = [(round(t, 2), round(i)) for t, i, _ in pick_peaks(grid, counts, max_peaks=PEAKS_SHOWN)]
    return {"target_fraction": fraction, "rwp": round(fit.rwp, 5), "detected": detected, "peaks": peaks}


#: held-out targets (one oxide, one intermetallic, one chalcogenide): test tasks only
TEST_TARGETS = frozenset({"ZrSiO4_141", "CuAu_123", "MoS2_194"})


def _split_of(target: str) -> Split:
    return "test" if target in TEST_TARGETS else "train"


class SynthesisEnv(Env):
    """See the module docstring."""

    env_id: ClassVar[str] = "lab/synthesis-v0"
    default_experiments: ClassVar[int] = 1
    invalid_action_reward: ClassVar[float] = 0.0

    def __init__(
        self,
        targets: Sequence[str] | None = None,
        max_experiments: int | None = None,
        lab_url: str | None = None,
        api_key_env: str = "LABRL_LAB_API_KEY",
        journal_path: str | None = None,
        fresh_journal: bool = False,
        run_id: str = "default",
        lab_concurrency: int = 8,
        mock_latency_s: float = 0.05,
        experiment_timeout_s: float = 600.0,
    ) -> None:
        experiments = self.default_experiments if max_experiments is None else max_experiments
        if experiments < 1:
            raise ConfigError(f"max_experiments must be >= 1, got {experiments}")
        if self.default_experiments == 1 and experiments != 1:
            raise ConfigError(f"{self.env_id} runs one experiment; use lab/synthesis-multiturn-v0 for more")
        chosen = list(targets) if targets is not None else list(recipes.TARGETS)
        unknown = [t for t in chosen if t not in recipes.TARGETS]
        if unknown or not chosen:
            raise ConfigError(f"unknown target(s) {unknown}; choose among {', '.join(recipes.TARGETS)}")
        self.settings = LabSettings(lab_url, api_key_env, journal_path, mock_latency_s, fresh_journal)
        check_settings(self.settings)
        self.max_experiments = experiments
        self.run_id = run_id
        self.tasks: dict[str, list[str]] = {"train": [], "test": []}
        for target in chosen:
            self.tasks[_split_of(target)].append(target)
        for split in ("train", "test"):  # never an empty split: borrow the first target of the other
            if not self.tasks[split]:
                other = self.tasks["test" if split == "train" else "train"]
                self.tasks[split].append(other.pop())
        self.spec = EnvSpec(
            id=self.env_id,
            description="Write a solid-state synthesis recipe for a target phase; scored by the lab's XRD.",
            budgets=Budgets(
                max_turns=experiments,
                step_timeout_s=experiment_timeout_s,
                scoring_timeout_s=120.0,
                reset_timeout_s=60.0,
                pools={"lab": lab_concurrency},
            ),
            tags=("lab", "materials", "synthesis", "xrd", "label-free")
            + (("multi-turn",) if experiments > 1 else ()),
            has_gold_answer=True,
        )
        self._experiments = 0
        self._best = 0.0

    def make_task(self, split: Split, seed: int) -> Task:
        from labrl.verifiers.xrd.library import load_library

        items = self.tasks[split]
        target = items[seed % len(items)]
        phase = load_library().get(target)
        return Task(
            env_id=self.env_id,
            split=split,
            seed=seed,
            task_id=f"synthesis-{target}",
            prompt={
                "formula": phase.formula,
                "space_group": phase.spacegroup_symbol,
                "space_group_number": phase.spacegroup_number,
                "max_experiments": self.max_experiments,
            },
            metadata={"target": target},
        )

    async def reset(self, task: Task) -> Observation:
        self._task = task
        self._experiments = 0
        self._best = 0.0
        p = task.prompt
        budget = (
            "You have one experiment."
            if self.max_experiments == 1
            else f"You have {self.max_experiments} experiments; after each you see the XRD peaks and "
            "the lab's phase analysis and may revise the recipe."
        )
        text = (
            f"Synthesize {p['formula']} (space group {p['space_group']}, No. {p['space_group_number']}) "
            f"phase-pure by a solid-state reaction. Precursors on the shelf: {', '.join(recipes.SHELF)}. "
            f"Atmospheres: {', '.join(recipes.ATMOSPHERES)} (vacuum = sealed evacuated ampoule). "
            f"Temperature {recipes.MIN_TEMPERATURE_C:g}-{recipes.MAX_TEMPERATURE_C:g} °C, "
            f"time up to {recipes.MAX_TIME_H:g} h, at most {recipes.MAX_PRECURSORS} precursors. "
            f"{budget} The product is measured by XRD; your reward is the target's weight fraction. "
            f"Answer with the recipe: {FORMAT}"
        )
        return Observation(messages=(Message(role="user", content=text),))

    def _recipe(self, action: Action) -> recipes.Recipe:
        if action.parse_error:
            raise InvalidActionError(action.parse_error)
        from labrl.verifiers.answers import extract_json

        return recipes.parse_recipe(extract_json(action.text, hint=f"Answer with the recipe: {FORMAT}"))

    async def _run(self, task: Task, recipe: recipes.Recipe) -> tuple[dict[str, Any] | None, str | None, str]:
        """Run one experiment; ``(xrd, error, key)``: ``xrd`` None when the lab's job failed."""
        request = {"kind": "synthesis", "recipe": recipe.to_json(), "sample_seed": task.seed}
        key = (
            f"{self.run_id}/{self.env_id}/{task.split}/{task.seed}/{task.task_id}/"
            f"exp{self._experiments}/{request_hash(request)[:16]}"
        )
        conn = await connection(self.settings)
        with lab_errors_as_env_errors(
            refused="the lab refused the recipe: {exc}", failed="lab failure: {kind}: {exc}"
        ):
            async with self.pool("lab"):
                outcome = await conn.lab.run(request, key)
        status = outcome.status
        if status.state is JobState.COMPLETED and status.result is not None:
            return status.result["xrd"], None, key
        if status.state is JobState.FAILED:
            return None, status.error or "the experiment failed", key
        if status.state is JobState.REJECTED:  # refused before (the journal replays the refusal)
            raise InvalidActionError(f"the lab refused the recipe: {status.error}")
        raise EnvError(f"experiment {key} ended {status.state.value}: {status.error}")

    async def step(self, action: Action) -> StepResult:
        task = self.episode_task()
        recipe = self._recipe(action)
        if self._experiments >= self.max_experiments:
            raise InvalidActionError(f"the budget of {self.max_experiments} experiment(s) is spent")
        xrd, error, key = await self._run(task, recipe)
        self._experiments += 1
        target = task.metadata["target"]
        if xrd is None:
            analysis: dict[str, Any] = {"target_fraction": 0.0, "error": error, "detected": {}, "peaks": []}
        else:
            candidates = sorted(set(recipes.candidate_phases(recipe)) | {target})
            analysis = await self.score(analyse, xrd, target, candidates, offload=True)
        score = reward_for(analysis["target_fraction"])
        previous, self._best = self._best, max(self._best, score)
        done = self._best >= 1.0 or self._experiments >= self.max_experiments
        left = self.max_experiments - self._experiments
        info = {
            "target_fraction": analysis["target_fraction"],
            "detected": analysis["detected"],
            "experiment": self._experiments,
            "job_key": key,
            **({"error": error} if error else {}),
        }
        report = _report(analysis, target, left if not done else 0)
        reward = score if self.max_experiments == 1 else self._best - previous
        return StepResult(
            observation=Observation(messages=(Message(role="user", content=report),)),
            reward=reward,
            done=done,
            info=info,
        )

    def gold_actions(self, task: Task) -> Sequence[Action] | None:
        return [Action(text=f"<answer>{json.dumps(recipes.gold_recipe(task.metadata['target']))}</answer>")]

    def random_action(self, task: Task, rng: random.Random) -> Action:
        shelf = list(recipes.SHELF)
        picks = rng.sample(shelf, rng.randint(1, 3))
        recipe = {
            "precursors": [{"formula": f, "mmol": rng.choice([5, 10, 15, 20])} for f in picks],
            "temperature_c": rng.choice(range(200, 1601, 50)),
            "time_h": rng.choice([1, 4, 12, 24, 48]),
            "atmosphere": rng.choice(recipes.ATMOSPHERES),
        }
        return Action(text=f"<answer>{json.dumps(recipe)}</answer>")


class SynthesisMultiTurnEnv(SynthesisEnv):
    env_id: ClassVar[str] = "lab/synthesis-multiturn-v0"
    default_experiments: ClassVar[int] = 3


def _report(analysis: dict[str, Any], target: str, left: int) -> str:
    if "error" in analysis:
        head = f"Experiment failed: {analysis['error']}."
    else:
        peaks = " ".join(f"{t:.2f}:{i}" for t, i in analysis["peaks"]) or "none"
        phases = ", ".join(f"{pid} {w:.1%}" for pid, w in analysis["detected"].items()) or "none"
        head = (
            f"XRD peaks 2θ:I {peaks}. Phase analysis (weight fractions): {phases}. "
            f"Target {target}: {analysis['target_fraction']:.1%}."
        )
    return head + (f" {left} experiment(s) left: send a revised recipe." if left else "")
