"""OpenEnv's own client (``GenericEnvClient(...).sync()``) against ``labrl envs serve --protocol openenv``."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from interop_servers import registered

openenv = pytest.importorskip("openenv")

from openenv.core.env_server.types import EnvironmentMetadata  # noqa: E402
from openenv.core.generic_client import GenericEnvClient  # noqa: E402
from openenv_test_servers import docs_python_block, docs_serve_command, serve_cli, serve_in_thread  # noqa: E402

from labrl.envs import make  # noqa: E402
from labrl.envs.actions import format_tool_call  # noqa: E402

XRD = "xrd/phase-id-tools-v0"


def gold_text(env_id: str, split: str, index: int, **options: object) -> str:
    env = make(env_id, **options)
    (action,) = env.gold_actions(env.make_task(split, index))  # type: ignore[misc]
    return action.text


def test_a_full_xrd_episode_with_a_tool_call_a_bad_action_and_the_gold_answer(xrd_server):
    with GenericEnvClient(base_url=xrd_server).sync() as client:
        opened = client.reset(split="test", index=3)
        assert opened.done is False and opened.reward is None
        task = opened.observation["task"]
        assert task == {"env_id": XRD, "split": "test", "seed": 3, "task_id": f"{XRD}:t1:test:3"}
        assert opened.observation["messages"][0]["role"] in ("system", "user")
        assert {"search_phases", "simulate", "fit"} <= {t["name"] for t in opened.observation["tools"]}

        searched = client.step({"text": format_tool_call("search_phases", {"elements": ["O"]})})
        assert searched.observation["outcome"] == "ok" and searched.reward is None and searched.done is False
        assert searched.observation["messages"][0]["role"] == "tool"

        bad = client.step({"text": "<tool_call>{not json</tool_call>"})
        assert bad.observation["outcome"] == "invalid_action" and bad.done is False
        assert bad.reward is None  # not the last turn: the model may correct itself
        assert "tool call" in bad.observation["error"]
        assert bad.observation["messages"][0]["content"].startswith("Invalid action:")

        answered = client.step({"text": gold_text(XRD, "test", 3)})
        assert answered.observation["outcome"] == "ok"
        assert answered.done is True and answered.reward == pytest.approx(1.0)

        state = client.state()
        assert state["step_count"] == 3 and state["done"] is True and state["reward"] == pytest.approx(1.0)
        assert state["task"]["seed"] == 3 and state["outcome"] == "ok"

        with pytest.raises(RuntimeError, match=r"no episode running.*EXECUTION_ERROR"):
            client.step({"text": "too late"})
        with pytest.raises(RuntimeError, match="unknown split 'dev'"):
            client.reset(split="dev", index=0)


def test_concurrent_sessions_each_hold_their_own_episode(xrd_server):
    indices = [0, 1, 2, 5]
    clients = [GenericEnvClient(base_url=xrd_server).sync() for _ in indices]
    try:
        for client in clients:
            client.connect()
        opened = [client.reset(split="train", index=i) for client, i in zip(clients, indices, strict=True)]
        assert [o.observation["task"]["seed"] for o in opened] == indices
        # all sessions are open at once; answer in reverse order: each session scores its own task
        for client, index in reversed(list(zip(clients, indices, strict=True))):
            result = client.step({"text": gold_text(XRD, "train", index)})
            assert result.done is True and result.reward == pytest.approx(1.0)
        # a session given another session's answer judges it against its own task's candidates
        again = clients[0].reset(split="train", index=0)
        assert again.observation["task"]["seed"] == 0
        wrong = clients[0].step({"text": gold_text(XRD, "train", 1)})
        assert wrong.observation["outcome"] == "invalid_action" and wrong.reward is None
        assert "is not one of the candidates" in wrong.observation["error"]
        episode_ids = {client.state()["episode_id"] for client in clients}
        assert len(episode_ids) == len(clients)
    finally:
        for client in clients:
            client.close()


def test_the_metadata_route_serves_the_manifest(xrd_server):
    served = httpx.get(f"{xrd_server}/metadata", timeout=30).json()
    shown = subprocess.run(
        [sys.executable, "-m", "labrl.cli", "envs", "show", XRD, "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    manifest = json.loads(shown.stdout)
    assert served == {
        **manifest,
        "dependencies": {**manifest["dependencies"], "packages": served["dependencies"]["packages"]},
    }
    assert served["dependencies"]["packages"][0].startswith("labrl[openenv]==")
    EnvironmentMetadata(
        **{k: served[k] for k in EnvironmentMetadata.model_fields if k in served}
    )  # its own shape
    assert served["name"] == XRD and served["version"] == "v0"
    schema = httpx.get(f"{xrd_server}/schema", timeout=30).json()
    assert "text" in schema["action"]["properties"] and "outcome" in schema["observation"]["properties"]


def test_the_task_routes_list_splits_and_tasks(xrd_server):
    base = f"{xrd_server}/xrd--phase-id-tools-v0"
    assert httpx.get(f"{base}/splits").json() == [
        {"name": "train", "type": "train"},
        {"name": "test", "type": "test"},
    ]
    assert httpx.post(f"{base}/num_tasks", json={"split": "test"}).json() == {"num_tasks": 1000}
    tasks = httpx.post(f"{base}/tasks", json={"split": "test"}, timeout=60).json()["tasks"]
    assert [t["seed"] for t in tasks] == list(range(1000)) and tasks[3]["task_id"] == f"{XRD}:t1:test:3"
    assert "answer" not in tasks[3]
    assert httpx.post(f"{base}/task", json={"split": "test", "index": 1000}).status_code == 400


@pytest.fixture(scope="module")
def fixture_envs():
    ids = {
        "test/slow-v0": "labrl_test_envs:SlowEnv",
        "test/crashing-v0": "labrl_test_envs:CrashingEnv",
        "test/broken-verifier-v0": "labrl_test_envs:BrokenVerifierEnv",
    }
    with registered(ids):
        yield


@pytest.mark.parametrize(
    ("env_id", "options", "outcome", "error"),
    [
        ("test/slow-v0", {}, "timeout", "step"),
        ("test/crashing-v0", {}, "env_error", "division by zero"),
        ("test/broken-verifier-v0", {}, "verifier_failed", "phase library missing"),
    ],
)
def test_failed_steps_end_the_episode_unscored(fixture_envs, env_id, options, outcome, error):
    with serve_in_thread(env_id, **options) as url, GenericEnvClient(base_url=url).sync() as client:
        client.reset(split="test", index=0)
        result = client.step({"text": "ANSWER: anything"})
        assert result.observation["outcome"] == outcome and error in result.observation["error"]
        assert result.done is True and result.reward is None  # never a 0
        assert "traceback" not in result.observation["info"]


def test_a_reset_that_fails_is_an_error_naming_its_kind(fixture_envs):
    with (
        serve_in_thread("test/crashing-v0", where="reset") as url,
        GenericEnvClient(base_url=url).sync() as client,
    ):
        with pytest.raises(RuntimeError, match=r"env_error: .*missing instrument calibration"):
            client.reset(split="test", index=0)


def test_a_lab_episode_against_the_in_process_mock_lab():
    env_id = "lab/synthesis-v0"
    with serve_cli(env_id) as url, GenericEnvClient(base_url=url).sync() as client:
        opened = client.reset(split="test", index=3)
        assert opened.observation["task"]["seed"] == 3
        result = client.step({"text": gold_text(env_id, "test", 3)})
        assert result.observation["outcome"] == "ok"
        assert result.done is True and result.reward == pytest.approx(1.0)


def test_a_lab_refusing_the_key_stops_the_session_unscored(tmp_path):
    from labrl.lab_adapters.mock.process import MockLabConfig, MockLabProcess
    from labrl.ports import free_port

    config = MockLabConfig(state_dir=tmp_path / "lab", port=free_port(), latency_median_s=0.05)
    with MockLabProcess(config, token="the-lab-token") as lab:
        options = ["-o", f"lab_url={lab.url}", "-o", f"journal_path={tmp_path / 'journal.sqlite'}"]
        with serve_cli("lab/synthesis-v0", *options, env={"LABRL_LAB_API_KEY": "not-the-token"}) as url:
            with GenericEnvClient(base_url=url).sync() as client:
                client.reset(split="test", index=3)
                answer = gold_text("lab/synthesis-v0", "test", 3)
                with pytest.raises(RuntimeError, match=r"HTTP 40[13].*refused the credentials"):
                    client.step({"text": answer})
                with pytest.raises(RuntimeError, match="refused the credentials"):
                    client.reset(split="test", index=4)  # the session stays stopped


def test_the_documented_client_runs_as_written(xrd_server, capsys):
    assert docs_serve_command()[:3] == ["envs", "serve", XRD]  # the command xrd_server runs
    code = docs_python_block()
    assert "http://127.0.0.1:8000" in code
    exec(compile(code.replace("http://127.0.0.1:8000", xrd_server), "docs/interop.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    task, reply = printed[0], printed[-1]
    assert f"'task_id': '{XRD}:t1:test:3'" in task
    assert reply == "ok None False"
