"""Refuse, before training, a model context that cannot hold the env's opening prompt.

A prompt of P tokens in a context of C leaves ``C - P`` tokens to generate; at
``P >= C`` the sampler answers ``abort`` and every episode ends as an
``env_error`` ("the first prompt does not fit the policy"): the run could only
drop groups until the stall guard stops it. ``check_opening_prompts_fit``
measures the prompt the run would send first, for the first ``PROBED_GROUPS``
train tasks (the tasks of groups 0, 1, ...: ``orchestrator.task_seed``),
tokenised by ``rollout.play.opening_prompt`` (the rollout's own first-turn
prompt), and raises ``ConfigError`` naming the prompt length, the context and
the key to change.

Only envs whose ``reset`` is local and quick are reset here
(``Env.reset_is_cheap()``, default False: a lab, a judge or a simulated
instrument wait is never started before training). A reset that fails leaves
its task unmeasured: the run's own episodes will report that failure.
"""

from __future__ import annotations

from collections.abc import Callable

from labrl.envs.base import Env
from labrl.errors import ConfigError
from labrl.harness.pipeline.orchestrator import task_seed
from labrl.harness.rollout.play import opening_prompt
from labrl.harness.tokenizer import Tokenizer

PROBED_GROUPS = 2
CONTEXT_KEY = "model.overrides.max_sequence_length"


async def check_opening_prompts_fit(
    make_env: Callable[[], Env], tokenizer: Tokenizer, *, context: int, run_seed: int, max_new_tokens: int
) -> None:
    """``ConfigError`` when the opening prompt of one of the run's first train tasks fills ``context``."""
    for index in range(PROBED_GROUPS):
        env = make_env()
        try:
            if not env.unwrapped.reset_is_cheap():
                return
            seed = task_seed(run_seed, index)
            prompt = await opening_prompt(env, env.make_task("train", seed), tokenizer)
        finally:
            await env.close()
        if prompt is not None and len(prompt) >= context:
            raise ConfigError(
                f"the first prompt does not fit the policy: {env.spec.id}'s train task {seed} opens with a "
                f"prompt of {len(prompt)} tokens, which leaves no room in the model's context of {context} "
                f"tokens, so every episode would fail; set {CONTEXT_KEY} to at least "
                f"{len(prompt) + max_new_tokens} (the prompt plus sampler.max_new_tokens = {max_new_tokens}), "
                "or give the env a shorter prompt"
            )
