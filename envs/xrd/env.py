"""The XRD phase-identification environments.

- ``xrd/phase-id-v0``: single turn. The model sees a peak list from a
  simulated powder measurement (and optionally a coarse profile) and answers
  which phase(s) are present; see ``tasks`` for the tiers.
- ``xrd/phase-id-tools-v0``: multi-turn. The model may call
  ``search_phases(elements)``, ``simulate(phase_id)``, ``fit(phase_ids)`` and
  ``submit(answer)`` within ``max_tool_calls`` calls; a plain-text reply is
  taken as the submission.
- ``xrd/phase-id-v1`` and ``xrd/phase-id-tools-v1``: the same with the v1
  library (cited common phases, ``formula_sg_pearson`` ids), answers drawn
  from experimental structures, and v1 physics (``tasks`` module docstring).
  The v1 ``simulate`` tool reports Kα1 sticks with the task's own physics,
  the same model the measurement and the fit use; v0's keeps the averaged
  Cu Kα of its published behaviour.

Rewards (``reward_mode``): ``label`` (F1 on (formula, space group), plus a
weight-fraction term for mixtures: ``labrl.verifiers.xrd.scoring``),
``label_free`` (fit the claimed phases to the measured counts and score the
Rwp improvement with a parsimony penalty: ``labrl.verifiers.xrd.fit``) or
``blend`` = (1 − α)·label + α·label_free. Only ``label`` guarantees that the
true answer scores exactly 1.0 (a fit to noisy counts rarely reaches Rexp).

The measurement (pattern simulation with noise, peak picking) runs in
``reset`` through ``run_cpu`` after ``instrument_latency_s``; fits run in
the pool after ``fit_latency_s``. ``make_task`` is pure and cheap.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from pydantic import ValidationError

from labrl.envs.actions import format_tool_call
from labrl.envs.base import Env
from labrl.envs.types import (
    Action,
    Budgets,
    EnvSpec,
    Message,
    Observation,
    Split,
    StepResult,
    Task,
    ToolCall,
    ToolSpec,
)
from labrl.envs.xrd.measure import observe
from labrl.envs.xrd.tasks import PhaseIdConfig, build_task_prompt, candidate_answer, render_prompt
from labrl.errors import ConfigError, EnvError, InvalidActionError
from labrl.offload import run_cpu
from labrl.untrusted_text import parse_off_loop
from labrl.verifiers.xrd.answer import FORMAT_HINT, ClaimedPhase, parse_answer
from labrl.verifiers.xrd.fit import fit_phase_ids
from labrl.verifiers.xrd.fit_config import FitResult
from labrl.verifiers.xrd.library import load_library
from labrl.verifiers.xrd.profile import Instrument, phase_sticks
from labrl.verifiers.xrd.scoring import label_score
from labrl.verifiers.xrd.simulate import stick_pattern

SINGLE_ID = "xrd/phase-id-v0"
TOOLS_ID = "xrd/phase-id-tools-v0"
SINGLE_V1_ID = "xrd/phase-id-v1"
TOOLS_V1_ID = "xrd/phase-id-tools-v1"
#: the answer label of a reply that named no phase of the library (it did not parse: an invalid action)
UNPARSED_ANSWER = "(unparsed)"
_V1_DEFAULTS = {"library": "v1", "answer_pool": "experimental", "physics": "v1", "fit": {"version": "v1"}}


def _config(env_id: str, options: dict[str, Any]) -> PhaseIdConfig:
    try:
        return PhaseIdConfig.model_validate(options)
    except ValidationError as exc:
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{env_id}: invalid option(s): {detail}") from None


class PhaseIdEnv(Env):
    """Single-turn phase identification (see the module docstring)."""

    env_id = SINGLE_ID
    defaults: ClassVar[dict[str, Any]] = {}  # option defaults of this env version
    options_model = PhaseIdConfig  # the accepted options (labrl envs show, "did you mean" on a typo)

    def __init__(self, **options: Any) -> None:
        self.config = _config(self.env_id, {**self.defaults, **options})
        self.library = load_library(self.config.library)  # parse once per process, up front
        self.spec = self._make_spec()
        self._observed: dict[str, Any] | None = None

    def _make_spec(self) -> EnvSpec:
        return EnvSpec(
            id=self.env_id,
            description="identify crystalline phases (and weight fractions) from a simulated Cu Ka powder pattern",
            budgets=Budgets(reset_timeout_s=60.0, step_timeout_s=120.0, scoring_timeout_s=60.0, max_turns=1),
            tags=("xrd", "materials", f"tier{self.config.tier}", self.config.reward_mode),
            license="Apache-2.0 (AFLOW prototypes: MIT)",
            has_gold_answer=True,
        )

    # -- tasks -------------------------------------------------------------------

    def make_task(self, split: Split, seed: int) -> Task:
        prompt, answer = build_task_prompt(self.config, split, seed)
        return Task(
            env_id=self.env_id,
            split=split,
            seed=int(seed),
            task_id=f"{self.env_id}:t{self.config.tier}:{split}:{seed}",
            prompt=prompt,
            answer=answer,
            metadata={"tier": self.config.tier, "phases": [p["id"] for p in answer["phases"]]},
        )

    async def reset(self, task: Task) -> Observation:
        if task.env_id != self.env_id:
            raise ConfigError(f"task {task.task_id!r} belongs to {task.env_id}, not {self.env_id}")
        self._task = task
        if self.config.instrument_latency_s:
            await asyncio.sleep(self.config.instrument_latency_s)
        args = (
            task.prompt["sample"],
            task.prompt["noise_seed"],
            self.config.n_peaks,
            self.config.profile_points,
        )
        self._observed = await run_cpu(observe, *args) if self.config.offload else observe(*args)
        if not self._observed["peaks"]:
            raise EnvError(f"{task.task_id}: the simulated pattern has no detectable peaks")
        text = render_prompt(self.config, task.prompt, self._observed)
        return Observation(messages=(Message(role="user", content=text),), tools=self.spec.tools)

    def reset_is_cheap(self) -> bool:
        """The measurement is a local simulation (tens of ms) unless an instrument latency is simulated."""
        return not self.config.instrument_latency_s

    # -- answers and rewards -------------------------------------------------------

    def _parse(self, text: str) -> list[ClaimedPhase]:
        task = self.episode_task()
        return parse_answer(text, self.library, candidates=task.prompt.get("candidates"))

    async def _fit(
        self, phase_ids: Sequence[str], claimed_fractions: dict[str, float] | None = None
    ) -> FitResult:
        """Fit ``phase_ids`` to the observed counts; ``claimed_fractions`` are scored by the v1 fit only."""
        assert self._observed is not None
        self.episode_task()  # EnvError before reset()
        if self.config.fit_latency_s:
            await asyncio.sleep(self.config.fit_latency_s)
        instrument = self._lab_instrument()
        args = (
            self._observed["two_theta"],
            self._observed["counts"],
            tuple(phase_ids),
            instrument,
            self.config.fit,
            claimed_fractions,
        )
        return await self.score(fit_phase_ids, *args, offload=self.config.offload)

    def _lab_instrument(self) -> Instrument:
        """The task's instrument as the lab knows it: its calibration, not the sample's displacement."""
        return Instrument.model_validate(self.episode_task().prompt["sample"]["instrument"]).model_copy(
            update={"zero_shift": 0.0, "displacement_mm": 0.0}
        )

    async def _reward(self, claimed: list[ClaimedPhase]) -> tuple[float, dict[str, Any]]:
        task = self.episode_task()
        truth = [(self.library.get(p["id"]), p["weight_fraction"]) for p in task.answer["phases"]]
        info: dict[str, Any] = {"claimed": [c.phase.id for c in claimed]}
        mode = self.config.reward_mode
        reward = 0.0
        if mode in ("label", "blend"):
            label = await self.score(label_score, claimed, truth)
            info["label"] = {
                "precision": label.precision,
                "recall": label.recall,
                "f1": label.f1,
                "wf_mae": label.wf_mae,
            }
            reward = label.reward
        if mode in ("label_free", "blend"):
            fractions = {c.phase.id: c.weight_fraction for c in claimed}
            given = bool(claimed) and all(w is not None for w in fractions.values())
            fit = await self._fit([c.phase.id for c in claimed], fractions if given else None)  # type: ignore[arg-type]
            info["fit"] = fit.summary()
            free = fit.reward
            reward = (
                free
                if mode == "label_free"
                else (1 - self.config.blend_weight) * reward + self.config.blend_weight * free
            )
        info["reward_mode"] = mode
        return float(min(max(reward, 0.0), 1.0)), info

    async def step(self, action: Action) -> StepResult:
        self.episode_task()  # EnvError before reset()
        if action.parse_error:
            raise InvalidActionError(action.parse_error)
        if action.tool_calls:
            raise InvalidActionError("this environment takes a direct answer, not tool calls. " + FORMAT_HINT)
        claimed = await parse_off_loop(self._parse, action.text)
        reward, info = await self._reward(claimed)
        return StepResult(reward=reward, done=True, info=info)

    # -- per-class evaluation ----------------------------------------------------------

    def task_label(self, task: Task) -> str | None:
        """The gold phase id(s), sorted and '+'-joined for a mixture (``CaSi6_166``, ``Ne_225+Os_194``)."""
        return phase_set_label(p["id"] for p in task.answer["phases"])

    def answer_label(self, task: Task, final_info: Mapping[str, Any]) -> str | None:
        """The claimed phase id(s) as ``task_label`` writes them; ``UNPARSED_ANSWER`` when nothing was claimed."""
        claimed = final_info.get("claimed")
        return phase_set_label(claimed) if claimed else UNPARSED_ANSWER

    # -- scripted actions ------------------------------------------------------------

    def _answer_text(self, phases: list[dict[str, Any]], with_weights: bool) -> str:
        items = []
        for p in phases:
            item = {"formula": p["formula"], "space_group": p["space_group"]}
            if with_weights:
                item["weight_fraction"] = p["weight_fraction"]
            items.append(item)
        return json.dumps({"phases": items})

    def gold_text(self, task: Task) -> str:
        if "letter" in task.answer:
            return candidate_answer(
                task.prompt["candidates"],
                task.answer["letter"],
                self.config.answer_format,
                self.config.library,
            )
        return self._answer_text(task.answer["phases"], with_weights=len(task.answer["phases"]) > 1)

    def gold_actions(self, task: Task) -> Sequence[Action] | None:
        return [Action(text=self.gold_text(task))]

    def random_text(self, task: Task, rng: random.Random) -> str:
        if task.prompt.get("candidates"):
            letter = rng.choice(sorted(task.prompt["candidates"]))
            return candidate_answer(
                task.prompt["candidates"], letter, self.config.answer_format, self.config.library
            )
        pool = self.library.search(task.prompt["elements"]) or list(self.library)
        n = len(task.answer["phases"])
        picks = rng.sample(pool, min(n, len(pool)))
        weights = [rng.random() + 0.1 for _ in picks]
        total = sum(weights)
        phases = [
            {"formula": p.formula, "space_group": p.spacegroup_number, "weight_fraction": round(w / total, 3)}
            for p, w in zip(picks, weights, strict=True)
        ]
        return self._answer_text(phases, with_weights=n > 1)

    def random_action(self, task: Task, rng: random.Random) -> Action:
        return Action(text=self.random_text(task, rng))


def phase_set_label(phase_ids: Iterable[str]) -> str:
    """One label for a set of phases: the ids sorted and '+'-joined (order of claim or mixture ignored)."""
    return "+".join(sorted(phase_ids))


def _required_object(**properties: dict[str, Any]) -> dict[str, Any]:
    """JSON schema of a tool's arguments: an object with every one of ``properties`` required."""
    return {"type": "object", "properties": properties, "required": list(properties)}


_TOOLS = (
    ToolSpec(
        name="search_phases",
        description="Phases of the library made only of the given elements (id, formula, space group).",
        parameters=_required_object(elements={"type": "array", "items": {"type": "string"}}),
    ),
    ToolSpec(
        name="simulate",
        description="The strongest Cu Ka peaks (2θ, relative intensity) of a library phase.",
        parameters=_required_object(phase_id={"type": "string"}),
    ),
    ToolSpec(
        name="fit",
        description="Fit phases to the measured pattern: Rwp, background-only Rwp and weight fractions.",
        parameters=_required_object(phase_ids={"type": "array", "items": {"type": "string"}}),
    ),
    ToolSpec(
        name="submit",
        description="Submit the final answer: {'phases': [{'formula', 'space_group', 'weight_fraction'}]}.",
        parameters=_required_object(answer={}),
    ),
)
_SEARCH_LIMIT = 25
_SIM_PEAKS = 10


class PhaseIdToolsEnv(PhaseIdEnv):
    """Multi-turn phase identification with search / simulate / fit tools."""

    env_id = TOOLS_ID

    def _make_spec(self) -> EnvSpec:
        return EnvSpec(
            id=self.env_id,
            description="identify crystalline phases from a simulated powder pattern using library search, "
            "simulation and full-profile fitting tools",
            budgets=Budgets(
                reset_timeout_s=60.0,
                step_timeout_s=120.0,
                scoring_timeout_s=60.0,
                max_turns=self.config.max_tool_calls + 2,
            ),
            tools=_TOOLS,
            tags=("xrd", "materials", "tools", f"tier{self.config.tier}", self.config.reward_mode),
            license="Apache-2.0 (AFLOW prototypes: MIT)",
            has_gold_answer=True,
        )

    async def reset(self, task: Task) -> Observation:
        self._calls = 0
        observation = await super().reset(task)
        (message,) = observation.messages
        intro = (
            f"{message.content}\nTools: search_phases, simulate, fit, submit "
            f"(at most {self.config.max_tool_calls} calls). Finish with submit."
        )
        return Observation(messages=(Message(role="user", content=intro),), tools=self.spec.tools)

    async def step(self, action: Action) -> StepResult:
        self.episode_task()  # EnvError before reset()
        if action.parse_error:
            raise InvalidActionError(action.parse_error)
        if not action.tool_calls:
            claimed = await parse_off_loop(self._parse, action.text)
            reward, info = await self._reward(claimed)
            return StepResult(reward=reward, done=True, info=info)
        messages = []
        for call in action.tool_calls:
            if call.name == "submit":
                claimed = self._submission(call)
                reward, info = await self._reward(claimed)
                return StepResult(reward=reward, done=True, info={**info, "tool_calls": self._calls})
            if self._calls >= self.config.max_tool_calls:
                raise InvalidActionError(
                    f"tool-call budget of {self.config.max_tool_calls} used up: call submit"
                )
            self._calls += 1
            content = await self._run_tool(call)
            messages.append(Message(role="tool", name=call.name, tool_call_id=call.id, content=content))
        return StepResult(observation=Observation(messages=tuple(messages)), info={"tool_calls": self._calls})

    def _submission(self, call: ToolCall) -> list[ClaimedPhase]:
        answer = call.arguments.get("answer")
        if answer is None:
            raise InvalidActionError('submit needs an "answer" argument. ' + FORMAT_HINT)
        return self._parse(answer if isinstance(answer, str) else json.dumps(answer))

    async def _run_tool(self, call: ToolCall) -> str:
        library = self.library
        args = call.arguments
        if call.name == "search_phases":
            elements = args.get("elements")
            if (
                not isinstance(elements, list)
                or not elements
                or not all(isinstance(e, str) for e in elements)
            ):
                raise InvalidActionError(
                    'search_phases needs "elements": a non-empty list of element symbols'
                )
            found = library.search(elements)
            rows = [
                {"id": p.id, "formula": p.formula, "space_group": p.spacegroup_symbol}
                for p in found[:_SEARCH_LIMIT]
            ]
            return json.dumps({"count": len(found), "phases": rows})
        if call.name == "simulate":
            phase_id = args.get("phase_id")
            if not isinstance(phase_id, str) or phase_id not in library:
                raise InvalidActionError(
                    f"simulate: unknown phase_id {phase_id!r} (use search_phases for ids)"
                )
            if self.config.physics == "v0":
                sticks = stick_pattern(library.get(phase_id), two_theta_range=(10.0, 80.0))
                positions, scaled = sticks.two_theta, sticks.scaled
            else:
                instrument = self._lab_instrument()
                positions, intensity = phase_sticks(library.get(phase_id), instrument)
                inside = (positions >= instrument.two_theta_min) & (positions <= instrument.two_theta_max)
                positions, intensity = positions[inside], intensity[inside]
                scaled = 100.0 * intensity / intensity.max() if len(intensity) else intensity
            top = sorted(zip(positions, scaled, strict=True), key=lambda x: -x[1])[:_SIM_PEAKS]
            reply: dict[str, Any] = {
                "phase_id": phase_id,
                "peaks": [[round(float(t), 2), round(float(i), 1)] for t, i in sorted(top)],
            }
            if self.config.physics != "v0":
                reply["wavelength"] = (
                    f"Ka1 {self._lab_instrument().wavelength_ka1} Å (Ka2 doublet not listed)"
                )
            return json.dumps(reply)
        if call.name == "fit":
            ids = args.get("phase_ids")
            if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
                raise InvalidActionError('fit needs "phase_ids": a non-empty list of phase ids')
            unknown = [i for i in ids if i not in library]
            if unknown:
                raise InvalidActionError(f"fit: unknown phase ids {unknown} (use search_phases for ids)")
            if len(set(ids)) != len(ids) or len(ids) > 5:
                raise InvalidActionError("fit: give at most 5 distinct phase ids")
            fit = await self._fit(ids)
            return json.dumps(
                {
                    "rwp": round(fit.rwp, 4),
                    "rwp_background_only": round(fit.rwp_background, 4),
                    "weight_fractions": {k: round(v, 3) for k, v in fit.weight_fractions.items()},
                }
            )
        raise InvalidActionError(
            f"unknown tool {call.name!r}; available: {', '.join(t.name for t in _TOOLS)}"
        )

    def gold_actions(self, task: Task) -> Sequence[Action] | None:
        answer = json.loads(
            self._answer_text(task.answer["phases"], with_weights=len(task.answer["phases"]) > 1)
        )
        text = format_tool_call("submit", {"answer": answer})
        return [
            Action(
                text=text, tool_calls=(ToolCall(id="call_0", name="submit", arguments={"answer": answer}),)
            )
        ]

    def random_action(self, task: Task, rng: random.Random) -> Action:
        text = self.random_text(task, rng)
        answer: Any = text if task.prompt.get("candidates") else json.loads(text)
        return Action(
            text=format_tool_call("submit", {"answer": answer}),
            tool_calls=(ToolCall(id="call_0", name="submit", arguments={"answer": answer}),),
        )


class PhaseIdEnvV1(PhaseIdEnv):
    """``xrd/phase-id-v1``: the v1 library, experimental answers and v1 physics by default."""

    env_id = SINGLE_V1_ID
    defaults = _V1_DEFAULTS


class PhaseIdToolsEnvV1(PhaseIdToolsEnv):
    """``xrd/phase-id-tools-v1``: the tools env with the v1 defaults."""

    env_id = TOOLS_V1_ID
    defaults = _V1_DEFAULTS
