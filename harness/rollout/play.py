"""Drive one episode of an env with a sampler and record it as token-level training data.

The episode loop is the envs' own ``run_episode``; the rollout hands it a
policy that keeps the conversation as tokens, never re-tokenising what the
model generated::

    turn 1: tokens  = chat_prompt(messages, tools)            loss 0
            tokens += generated                               loss 1, behaviour log-probs, versions
    turn k: tokens += close_turn(generated)                   loss 0 (only if the turn hit max tokens)
            tokens += continuation(history, new messages)     loss 0 (tool results, user replies)
            tokens += generated                               loss 1

A turn whose prompt leaves no room in the context (the sampler answers
``abort`` with no tokens) is dropped and the episode ends truncated with
``finish_reason="length"``; on the first turn it is an ``env_error``.

Routed experts: each ``generate`` reports routing for its whole prompt and
output. A token keeps the routing of the forward that first processed it
(the one whose log-probs the learner sees), so rows already known from an
earlier turn are kept and only new rows are appended; the last row of a
result (the never-fed final token) is replaced when the next turn processes
that token.

Where the env labels its tasks (``Env.task_label``), ``Trajectory.info`` carries
``task_label`` and ``answer_label`` (``episode_labels``) for per-class evaluation; a cascade
env's episode carries its ``CascadeRecord`` as ``cascade`` (every stage reached, its value and cost).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from labrl.envs.base import Env
from labrl.envs.cascade import CascadeEnv, GroupGate
from labrl.envs.episode import Episode, EpisodeTruncated, run_episode
from labrl.envs.types import Message, Task, ToolSpec
from labrl.harness.tokenizer import Tokenizer
from labrl.harness.types import (
    NO_VERSION,
    EpisodeTimeline,
    GenerateRequest,
    Sampler,
    SamplingParams,
    Trajectory,
)

#: index of the group member whose episode runs in this asyncio task (None outside ``rollout_group``);
#: lets infrastructure under the env (the Ray lab gateway) tell a group's episodes apart
current_member: contextvars.ContextVar[int | None] = contextvars.ContextVar("current_member", default=None)


@dataclass
class _Recorder:
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed: np.ndarray | None = None
    routed_valid: int = 0  # rows of `routed` that are real (not the padded last row)
    messages_seen: int = 0
    last_output: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    generation_s: float = 0.0
    turn_generation_s: list[float] = field(default_factory=list)
    turn_tokens: list[int] = field(default_factory=list)
    turns: int = 0

    def truncate(self, length: int) -> None:
        """Drop the token rows past ``length`` (``routed`` only ever covers rows already fed)."""
        for rows in (self.tokens, self.loss_mask, self.logprobs, self.versions):
            del rows[length:]

    def extend(self, ids: Sequence[int], *, generated: bool, logprobs=None, versions=None) -> None:
        self.tokens.extend(ids)
        self.loss_mask.extend([1 if generated else 0] * len(ids))
        self.logprobs.extend(logprobs if generated else [0.0] * len(ids))
        self.versions.extend(versions if generated else [NO_VERSION] * len(ids))


def first_turn_prompt(
    tokenizer: Tokenizer, messages: Sequence[Message], tools: Sequence[ToolSpec]
) -> list[int]:
    """The tokens of turn 1's prompt: the chat template over the env's opening messages and tools."""
    return tokenizer.chat_prompt(messages, tools)


async def opening_prompt(env: Env, task: Task, tokenizer: Tokenizer) -> list[int] | None:
    """The prompt ``rollout`` sends the sampler on the first turn of ``task``; None when ``reset`` failed.

    Runs the envs' episode loop (reset, the opening messages and tools) up to its first policy
    call, which builds the prompt as ``rollout`` does and ends the episode unanswered.
    """
    prompt: list[int] = []

    async def measure(messages: Sequence[Message], tools: Sequence[ToolSpec]) -> str:
        prompt.extend(first_turn_prompt(tokenizer, messages, tools))
        raise EpisodeTruncated("the opening prompt is measured, not answered")

    await run_episode(env, task, measure, max_turns=1)
    return prompt or None


async def rollout(
    env: Env,
    task: Task,
    sampler: Sampler,
    tokenizer: Tokenizer,
    sampling: SamplingParams,
    *,
    group_id: str | None = None,
    return_routed_experts: bool = False,
    max_turns: int | None = None,
    rid_prefix: str = "",
) -> Trajectory:
    """Play ``task`` on ``env`` with ``sampler``; see the module docstring."""
    if not sampling.stop_token_ids:
        sampling = sampling.model_copy(update={"stop_token_ids": tuple(tokenizer.stop_token_ids)})
    rec = _Recorder()

    async def policy(messages: Sequence[Message], tools: Sequence[ToolSpec]) -> str:
        turn_start = len(rec.tokens)
        if rec.turns == 0:
            rec.extend(first_turn_prompt(tokenizer, messages, tools), generated=False)
        else:
            rec.extend(tokenizer.close_turn(rec.last_output), generated=False)
            history, new = messages[: rec.messages_seen], messages[rec.messages_seen :]
            rec.extend(tokenizer.continuation(history, new, tools), generated=False)
        request = GenerateRequest(
            rid=f"{rid_prefix}{task.task_id}/{rec.turns}",
            input_ids=tuple(rec.tokens),
            sampling=sampling,
            return_routed_experts=return_routed_experts,
        )
        t0 = time.perf_counter()
        (result,) = await sampler.generate([request])
        generation_s = time.perf_counter() - t0
        rec.generation_s += generation_s
        rec.turn_generation_s.append(generation_s)
        rec.turn_tokens.append(len(result.output_ids))
        if result.finish_reason == "abort":
            # The prompt left no room to generate: the conversation outgrew the context. The turn
            # that did not fit is dropped and the episode ends truncated, as a generation that hit
            # its length limit (the overlong policy decides whether it is trained).
            rec.truncate(turn_start)
            rec.finish_reason = "length"
            raise EpisodeTruncated(result.info.get("error") or "the conversation outgrew the context window")
        if result.routed_experts_T_L_K is not None:
            rows = result.routed_experts_T_L_K
            known = rec.routed[: rec.routed_valid] if rec.routed is not None else rows[:0]
            rec.routed = np.concatenate([known, rows[rec.routed_valid :]], axis=0)
            rec.routed_valid = len(rows) - 1
        rec.extend(result.output_ids, generated=True, logprobs=result.logprobs_T, versions=result.versions_T)
        rec.last_output = list(result.output_ids)
        rec.finish_reason = result.finish_reason
        rec.turns += 1
        rec.messages_seen = len(messages) + 1  # the assistant message the runner appends next
        return tokenizer.decode(result.output_ids, skip_special_tokens=True)

    started = time.perf_counter()
    episode = await run_episode(env, task, policy, max_turns=max_turns)
    wall = time.perf_counter() - started
    return Trajectory(
        env_id=episode.env_id,
        task_id=task.task_id,
        group_id=group_id if group_id is not None else task.task_id,
        tokens_T=rec.tokens,
        loss_mask_T=rec.loss_mask,
        logprobs_T=rec.logprobs,
        versions_T=rec.versions,
        reward=episode.reward,
        outcome=episode.outcome.value,
        finish_reason=rec.finish_reason,  # type: ignore[arg-type]
        num_turns=episode.num_turns,
        routed_experts_T_L_K=rec.routed,
        timings={"generation_s": rec.generation_s, "env_s": episode.timings["env_s"], "wall_s": wall},
        info={**_error_info(episode), **episode_labels(env, episode), **_cascade_info(episode)},
        timeline=EpisodeTimeline(
            generation_s=tuple(rec.turn_generation_s),
            generated_tokens=tuple(rec.turn_tokens),
            env_s=(episode.timings["reset_s"], *(t.env_s for t in episode.turns)),
        ),
    )


def _error_info(episode: Episode) -> dict[str, str]:
    """What went wrong in a failed episode: one line (``error``) and the full ``traceback`` when known."""
    info = {}
    if episode.error:
        info["error"] = episode.error
    if episode.traceback:
        info["traceback"] = episode.traceback
    return info


def _cascade_info(episode: Episode) -> dict[str, object]:
    """A cascade env's ``CascadeRecord`` of the episode (``cascade``: what each stage scored and cost)."""
    final_info = episode.turns[-1].result.info if episode.turns else {}
    return {"cascade": final_info["cascade"]} if "cascade" in final_info else {}


def episode_labels(env: Env, episode: Episode) -> dict[str, str]:
    """``task_label`` and ``answer_label`` of the episode, where the env labels its tasks (``Env.task_label``).

    An episode that failed (outcome not trainable) is answered ``(<outcome>)``, e.g. ``(timeout)``:
    the env judged no answer, and the breakdown still counts it where it went.
    """
    label = env.task_label(episode.task)
    if label is None:
        return {}
    if not episode.outcome.trainable:
        answer: str | None = f"({episode.outcome.value})"
    else:
        final_info = episode.turns[-1].result.info if episode.turns else {}
        answer = env.answer_label(episode.task, final_info)
    return {"task_label": label, **({"answer_label": answer} if answer is not None else {})}


def join_cascade_group(env: Env, gate: GroupGate, member: int) -> None:
    """Join ``env`` to its group's ``gate`` as ``member`` where it is a cascade whose rules need the group."""
    inner = env.unwrapped
    if isinstance(inner, CascadeEnv) and inner.needs_group_gate:
        inner.join_group(gate, member)


def nth_draw(sampling: SamplingParams, i: int) -> SamplingParams:
    """The sampling of the ``i``-th of several episodes: seeded sampling gets seed ``seed + i``, so
    episodes sharing one seed still draw different noise; unseeded sampling is returned as is."""
    if sampling.seed is None:
        return sampling
    return sampling.model_copy(update={"seed": sampling.seed + i})


async def rollout_group(
    make_env: Callable[[], Env],
    task: Task,
    sampler: Sampler,
    tokenizer: Tokenizer,
    sampling: SamplingParams,
    group_size: int,
    *,
    return_routed_experts: bool = False,
    max_turns: int | None = None,
) -> list[Trajectory]:
    """``group_size`` concurrent rollouts of one task (one env instance each), sharing a group id.

    Seeded sampling gets seed ``seed + i`` for member ``i`` so the group's
    members differ. A cascade env whose rule decides by the group (``CascadeEnv.needs_group_gate``)
    joins the group's shared ``GroupGate``; every member leaves it when its episode is over, however
    it ended, so no member waits for one that will never report.
    """
    gate = GroupGate(group_size)

    async def one(i: int) -> Trajectory:
        current_member.set(i)  # gather runs each member in its own task: the value stays in it
        member = nth_draw(sampling, i)
        try:
            env = make_env()
            join_cascade_group(env, gate, i)
            try:
                return await rollout(
                    env, task, sampler, tokenizer, member,
                    group_id=task.task_id, return_routed_experts=return_routed_experts,
                    max_turns=max_turns, rid_prefix=f"g{i}:",
                )  # fmt: skip
            finally:
                await env.close()
        finally:
            gate.leave(i)

    return list(await asyncio.gather(*(one(i) for i in range(group_size))))
