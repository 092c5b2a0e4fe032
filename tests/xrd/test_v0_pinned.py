"""``xrd/phase-id-v0`` and ``xrd/phase-id-tools-v0`` stay bit-identical.

The digests below were captured on main at 895bacc, before the v1 library and
physics were added. They cover, per env and tier, the task (id, prompt,
answer, metadata), the rendered first message and the simulated counts, and
the tools env's ``simulate`` reply. A change here breaks the quickstart's
published curve: bump to a new env version instead.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from labrl.envs.registry import make
from labrl.envs.types import Action, ToolCall
from labrl.envs.xrd.measure import observe

PINNED = {
    ("xrd/phase-id-v0", 1): ("fe9c61345c4b3ba8", "66b65b90f31be38a", "e541ffe11f9e24db"),
    ("xrd/phase-id-v0", 2): ("d110ef03a83cc10e", "773d342b6a9033e4", "708a29243e0865e6"),
    ("xrd/phase-id-v0", 3): ("57ed1226c8dd7251", "8c5249d765cf7007", "a7472accc9bc996c"),
    ("xrd/phase-id-tools-v0", 1): ("b9d50db6d874630f", "3785533ba3af1323", "e541ffe11f9e24db"),
    ("xrd/phase-id-tools-v0", 2): ("b3d8493344e31410", "67a1e0bc164f69c5", "708a29243e0865e6"),
    ("xrd/phase-id-tools-v0", 3): ("84b5f7415d8efddc", "0951a25b9bae6850", "a7472accc9bc996c"),
}
SIMULATE_CRSI2 = (
    '{"phase_id": "CrSi2_180", "peaks": [[27.15, 19.6], [36.69, 8.7], [40.76, 15.0], [42.59, 39.4], '
    "[43.27, 100.0], [47.42, 4.2], [50.19, 62.7], [60.42, 8.7], [73.23, 19.2], [75.93, 17.3]]}"
)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


@pytest.mark.parametrize(("env_id", "tier"), sorted(PINNED))
async def test_v0_task_message_and_counts_are_pinned(env_id, tier):
    env = make(env_id, tier=tier, offload=False)
    task = env.make_task("test", 7)
    obs = await env.reset(task)
    counts = np.asarray(observe(task.prompt["sample"], task.prompt["noise_seed"], 6, 0)["counts"])
    got = (
        _digest([task.task_id, task.prompt, task.answer, task.metadata]),
        _digest(obs.messages[0].content),
        hashlib.sha256(counts.tobytes()).hexdigest()[:16],
    )
    assert got == PINNED[(env_id, tier)]


async def test_v0_tools_simulate_reply_is_pinned():
    env = make("xrd/phase-id-tools-v0", tier=2, offload=False)
    task = env.make_task("test", 7)
    await env.reset(task)
    assert task.answer["phases"][0]["id"] == "CrSi2_180"
    call = ToolCall(id="c", name="simulate", arguments={"phase_id": "CrSi2_180"})
    result = await env.step(Action(text="", tool_calls=(call,)))
    assert result.observation.messages[0].content == SIMULATE_CRSI2
