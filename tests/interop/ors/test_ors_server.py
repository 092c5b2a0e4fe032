"""The Open Reward Standard SDK's own client against ``labrl envs serve --protocol ors``."""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

pytest.importorskip("openreward")

from interop_servers import serve_argv
from openreward import OpenReward
from openreward.api.errors import ToolCallError, ToolFailed
from ors_servers import docs_python_block, docs_serve_command, serve_in_thread

from labrl.envs import make
from labrl.envs.types import Action

XRD = "xrd/phase-id-tools-v0"


def gold(env_id: str, split: str, index: int) -> Action:
    env = make(env_id)
    (action,) = env.gold_actions(env.make_task(split, index))  # type: ignore[misc]
    return action


def opening_texts(env_id: str, split: str, index: int) -> list[str]:
    """The opening prompt labrl's own API shows for the task."""
    env = make(env_id)
    observation = asyncio.run(env.reset(env.make_task(split, index)))  # type: ignore[arg-type]
    return [message.content for message in observation.messages]


def play(session: Any, action: Action) -> Any:
    """An ORS harness's turn: a tool call goes to its tool, a plain reply to the terminal tool."""
    if action.tool_calls:
        (call,) = action.tool_calls
        return session.call_tool(call.name, call.arguments)
    return session.call_terminal_tool(action.text)


def environment(url: str, env_id: str = XRD) -> Any:
    return OpenReward(api_key="local").environments.get(env_id, base_url=url)


def test_a_full_xrd_episode_with_a_tool_call_a_bad_call_and_the_gold_answer(xrd_server):
    env = environment(xrd_server)
    assert env.list_splits() == ["train", "test"] and env.num_tasks("test") == 1000
    task = env.get_task("test", 3)
    assert task.task_spec == {"env_id": XRD, "split": "test", "seed": 3, "task_id": f"{XRD}:t1:test:3"}
    tools = {tool.name: tool for tool in env.list_tools()}
    assert set(tools) == {"search_phases", "simulate", "fit", "submit"}  # the terminal tool is hidden
    search = next(t for t in make(XRD).spec.tools if t.name == "search_phases")
    assert tools["search_phases"].input_schema == search.parameters  # the env's own JSON schema
    assert env.terminal_tool().name == "answer" and env.terminal_tool().arg == "text"

    with env.session(split="test", index=3) as session:
        messages = session.get_messages()
        assert [m.blocks[0].text for m in messages] == opening_texts(XRD, "test", 3)
        assert [b.text for b in session.get_prompt()] == [messages[0].blocks[0].text]  # one user message

        searched = session.call_tool("search_phases", {"elements": ["O"]})
        assert searched.reward is None and searched.finished is False
        assert searched.metadata["outcome"] == "ok" and '"phases"' in searched.blocks[0].text

        bad = session.call_tool("simulate", {"no_such_argument": 1})
        assert bad.metadata["outcome"] == "invalid_action" and bad.reward is None and bad.finished is False
        assert bad.blocks[0].text.startswith("Invalid action:") and bad.metadata["error"]

        answered = play(session, gold(XRD, "test", 3))
        assert answered.metadata == {**answered.metadata, "outcome": "ok", "truncated": False, "error": None}
        assert answered.finished is True and answered.reward == pytest.approx(1.0)

        with pytest.raises(ToolCallError) as late:
            session.call_tool("search_phases", {"elements": ["O"]})
        assert late.value.reason == "episode_finished"
    with pytest.raises(Exception, match="400"):
        env.get_task("test", 1000)


def test_concurrent_sessions_each_hold_their_own_episode(xrd_server):
    env = environment(xrd_server)
    indices = [0, 1, 2, 5]
    sessions = [env.session(split="train", index=i) for i in indices]
    try:
        for session in sessions:
            session.__enter__()
        # all sessions are open at once; answer at once, in reverse order: each scores its own task
        with ThreadPoolExecutor(len(sessions)) as pool:
            answered = list(
                pool.map(
                    lambda pair: play(pair[0], gold(XRD, "train", pair[1])),
                    reversed(list(zip(sessions, indices, strict=True))),
                )
            )
        assert [a.reward for a in answered] == [pytest.approx(1.0)] * len(indices)
        assert len({session.sid for session in sessions}) == len(sessions)
    finally:
        for session in sessions:
            session.__exit__(None, None, None)
    # another task's answer, judged against this session's own task's candidates
    with env.session(split="train", index=0) as session:
        wrong = play(session, gold(XRD, "train", 1))
        assert wrong.metadata["outcome"] == "invalid_action" and wrong.reward is None
        assert "is not one of the candidates" in wrong.metadata["error"]


def test_a_plain_reply_goes_to_the_terminal_tool(fixture_envs):
    with serve_in_thread("test/echo-v0") as url:
        env = environment(url, "test/echo-v0")
        assert env.list_tools() == [] and env.terminal_tool().name == "answer"
        assert env.num_tasks("train") == 5
        with env.session(split="train", index=2) as session:
            assert session.get_prompt()[0].text == opening_texts("test/echo-v0", "train", 2)[0]
            answered = session.call_terminal_tool(gold("test/echo-v0", "train", 2).text)
            assert answered.reward == pytest.approx(1.0) and answered.finished is True
        with env.session(split="train", index=2) as session:
            wrong = session.call_terminal_tool("ANSWER: not-the-word")
            assert wrong.reward == 0.0 and wrong.metadata["outcome"] == "ok"


@pytest.mark.parametrize(
    ("env_id", "outcome", "error"),
    [
        ("test/slow-v0", "timeout", "step"),
        ("test/crashing-v0", "env_error", "division by zero"),
        ("test/broken-verifier-v0", "verifier_failed", "phase library missing"),
    ],
)
def test_failed_steps_end_the_episode_unscored(fixture_envs, env_id, outcome, error):
    with serve_in_thread(env_id) as url, environment(url, env_id).session(split="test", index=0) as session:
        result = session.call_terminal_tool("ANSWER: anything")
        assert result.metadata["outcome"] == outcome and error in result.metadata["error"]
        assert result.finished is True and result.reward is None  # never a 0
        assert "traceback" not in result.metadata["info"]


def test_a_reset_that_fails_is_an_error_naming_its_kind(fixture_envs):
    with serve_in_thread("test/crashing-v0", where="reset") as url:
        with environment(url, "test/crashing-v0").session(split="test", index=0) as session:
            with pytest.raises(Exception, match=r"env_error: .*missing instrument calibration"):
                session.get_prompt()


def test_sessions_beyond_the_cap_are_refused_with_retry_after(fixture_envs):
    with serve_in_thread("test/echo-v0", max_sessions=1) as url:

        def create() -> httpx.Response:
            headers = {"X-Session-ID": uuid.uuid4().hex}
            return httpx.post(
                f"{url}/create", json={"split": "test", "index": 0}, headers=headers, timeout=30
            )

        first = create()
        assert first.status_code == 200
        refused = create()
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "2"
        httpx.post(f"{url}/delete", headers={"X-Session-ID": first.json()["sid"]}, timeout=30)
        assert create().status_code == 200  # the deleted session's place is free again


def test_a_lab_refusing_the_key_stops_the_session_unscored(tmp_path):
    from labrl.lab_adapters.mock.process import MockLabConfig, MockLabProcess
    from labrl.ports import free_port

    env_id = "lab/synthesis-v0"
    config = MockLabConfig(state_dir=tmp_path / "lab", port=free_port(), latency_median_s=0.05)
    with MockLabProcess(config, token="the-lab-token") as lab:
        options = ["-o", f"lab_url={lab.url}", "-o", f"journal_path={tmp_path / 'journal.sqlite'}"]
        argv = ["envs", "serve", env_id, "--protocol", "ors", *options]
        with serve_argv(argv, env={"LABRL_LAB_API_KEY": "not-the-token"}) as url:
            with environment(url, env_id).session(split="test", index=3) as session:
                with pytest.raises(ToolFailed, match=r"HTTP 40[13].*refused the credentials"):
                    play(session, gold(env_id, "test", 3))
                with pytest.raises(Exception, match="refused the credentials"):
                    play(session, gold(env_id, "test", 3))  # the client marked the session dead
            # the server keeps a refused session stopped too: a client that calls again is refused again
            action = gold(env_id, "test", 3)
            (tool_call,) = action.tool_calls or [None]
            call = (
                {"name": tool_call.name, "input": tool_call.arguments}
                if tool_call is not None
                else {"name": "answer", "input": {"text": action.text}}
            )
            headers = {"X-Session-ID": uuid.uuid4().hex}
            httpx.post(f"{url}/create", json={"split": "test", "index": 3}, headers=headers, timeout=60)
            for _ in range(2):
                refused = httpx.post(f"{url}/lab--synthesis-v0/call", json=call, headers=headers, timeout=60)
                assert "event: error" in refused.text and "refused the credentials" in refused.text
                assert '"reward"' not in refused.text


def test_the_documented_client_runs_as_written(xrd_server, capsys):
    assert docs_serve_command() == ["envs", "serve", XRD, "--protocol", "ors", "--port", "8080"]
    code = docs_python_block()
    assert "http://127.0.0.1:8080" in code
    exec(compile(code.replace("http://127.0.0.1:8080", xrd_server), "docs/interop.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "['train', 'test'] 1000 ['fit', 'search_phases', 'simulate', 'submit']"
    assert printed[-1] == "ok 1.0 True"
    assert "None False" in printed[-2]
