"""A lab env whose every action is an experiment, for the Ray fault tests (imported in every Ray worker).

``lab/synthesis-v0`` turns only well-formed JSON recipes into lab jobs; a tiny
untrained model writes none. ``AnyTextSynthesisEnv`` maps any action text to a
valid recipe, deterministically (the text seeds the draw), so the same text
is the same lab request and idempotency key; everything below the recipe (the
journaled lab, the gateway, the mock lab) is the real path.
"""

from __future__ import annotations

import hashlib
import random
from typing import ClassVar

from labrl.envs import Action, register, registered_ids
from labrl.envs.lab.synthesis import SynthesisEnv
from labrl.lab_adapters import recipes

ENV_ID = "test/synthesis-anytext-v0"


class AnyTextSynthesisEnv(SynthesisEnv):
    env_id: ClassVar[str] = ENV_ID

    def _recipe(self, action: Action) -> recipes.Recipe:
        rng = random.Random(hashlib.sha256(action.text.encode()).digest())
        return super()._recipe(self.random_action(self.episode_task(), rng))


def register_all() -> None:
    """Ray's ``worker_process_setup_hook``: every worker process knows the test envs."""
    if ENV_ID not in registered_ids():
        register(ENV_ID, entry_point="ray_test_envs:AnyTextSynthesisEnv")
