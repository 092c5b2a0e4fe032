"""labrl's ORS server beyond one plain episode, through the SDK's client: refused calls, task
listings, the reaper of idle sessions, a call resumed by its task id, a long call's keepalive."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("openreward")

import aiohttp
from openreward import AsyncOpenReward
from openreward.api._session.http import resumable_sse
from openreward.api.errors import ToolCallError
from ors_servers import serve_in_thread
from test_ors_server import environment, gold

from labrl.interop import ors_server

ECHO = "test/echo-v0"


def test_calls_that_are_no_step_are_refused_by_reason_and_tasks_are_listed(fixture_envs):
    with serve_in_thread(ECHO) as url:
        env = environment(url, ECHO)
        assert [task.task_spec["seed"] for task in env.list_tasks("test")] == [0, 1, 2, 3, 4]
        assert [task.task_spec["seed"] for task in env.get_task_range("test", 1, -1)] == [1, 2, 3]
        with env.session(split="test", index=1) as session:
            with pytest.raises(ToolCallError) as missing:
                session.call_tool("no_such_tool", {})
            assert missing.value.reason == "not_found"
            with pytest.raises(ToolCallError) as malformed:
                session.call_tool("answer", {"reply": "ANSWER: x"})
            assert malformed.value.reason == "input_validation"
            # neither was a step: the episode still takes its one answer
            answered = session.call_terminal_tool(gold(ECHO, "test", 1).text)
            assert answered.reward == pytest.approx(1.0) and answered.finished is True


def test_a_prompt_of_several_messages_is_flattened_with_a_role_block_before_each():
    judged = "judged/science-qa-v0"  # a system and a user message
    with serve_in_thread(judged) as url, environment(url, judged).session(split="test", index=0) as session:
        messages = session.get_messages()
        assert [m.role for m in messages] == ["system", "user"]
        flattened = [text for m in messages for text in (f"[{m.role}]", m.blocks[0].text)]
        assert [block.text for block in session.get_prompt()] == flattened


def test_a_session_left_idle_past_its_ttl_is_reaped_and_its_place_freed(fixture_envs):
    ttl = {"session_ttl_s": 0.5, "reap_every_s": 0.1}
    with serve_in_thread(ECHO, max_sessions=1, server=ttl) as url:
        env = environment(url, ECHO)
        with env.session(split="train", index=0) as idle:
            assert idle.get_prompt()
            time.sleep(1.5)  # the client pings at the start, then every 10 s: past the TTL here
            with pytest.raises(aiohttp.ClientResponseError) as gone:
                idle.get_prompt()
            assert gone.value.status == 404
            # the reaped session's env was closed and its place freed: a session of max_sessions=1 opens
            with env.session(split="train", index=1) as fresh:
                answered = fresh.call_terminal_tool(gold(ECHO, "train", 1).text)
                assert answered.reward == pytest.approx(1.0)


async def _call(session: Any, text: str, task_id: str | None = None, **options: Any) -> tuple[Any, list[str]]:
    """The SDK's own SSE call (what ``call_tool`` runs), with the events it saw."""
    events: list[str] = []
    result = await resumable_sse(
        session.client, "/call", "local", sid=session.sid, task_id=task_id,
        json={"name": "answer", "input": {"text": text}},
        on_event=lambda name, data: events.append(f"{name}:{data}"), **options,
    )  # fmt: skip
    return result, events


async def test_a_call_resumed_by_its_task_id_answers_its_one_run(fixture_envs):
    with serve_in_thread(ECHO) as url:
        api = AsyncOpenReward(api_key="local").environments
        try:
            async with api.get(ECHO, base_url=url).session(split="train", index=2) as session:
                first, events = await _call(session, gold(ECHO, "train", 2).text)
                (task_id,) = [e.split(":", 1)[1] for e in events if e.startswith("task_id:")]
                again, _ = await _call(session, "ANSWER: ignored", task_id=task_id)
                # the same outcome, not a second step (which the finished episode would refuse)
                assert again == first and first["ok"] and first["output"]["reward"] == pytest.approx(1.0)
                with pytest.raises(RuntimeError, match="unknown task_id"):
                    await _call(session, "ANSWER: x", task_id="no-such-call")
        finally:
            await api.aclose()


async def test_a_long_call_keeps_its_stream_alive(fixture_envs, monkeypatch):
    monkeypatch.setattr(ors_server, "KEEPALIVE_S", 0.2)
    with serve_in_thread(ECHO, step_delay=1.5) as url:
        api = AsyncOpenReward(api_key="local").environments
        try:
            async with api.get(ECHO, base_url=url).session(split="train", index=3) as session:
                # the client gives up on a stream silent for heartbeat_timeout (1 s here): the step takes 1.5 s
                result, events = await _call(session, gold(ECHO, "train", 3).text, heartbeat_timeout=1)
                assert result["ok"] and result["output"]["reward"] == pytest.approx(1.0)
                assert [e.split(":", 1)[0] for e in events] == ["task_id", "end"]
        finally:
            await api.aclose()
