"""A lab refusing our key stops the env (never a reward); echoed keys are redacted; SIGTERM leaves no orphans."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
import textwrap
import uuid

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labrl.envs import make, run_episode, scripted_policy
from labrl.errors import LabAuthError
from labrl.lab_adapters.rest import RestLabAdapter, RestLabConfig
from labrl.redact import MASK, redact

from .conftest import TOKEN


def _echoing_lab(status: int):
    """A lab that answers ``status`` and quotes the request's headers back, as a careless proxy does."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            status,
            json={"detail": f"bad credentials; you sent Authorization: {request.headers['authorization']}"},
        )

    return RestLabAdapter(
        RestLabConfig(base_url="http://127.0.0.1:9", rate_limit_per_s=None, backoff_base_s=0.001),
        transport=httpx.MockTransport(handler),
    )


@pytest.mark.parametrize("status", [401, 403])
async def test_auth_refusal_is_typed_and_the_echoed_key_is_redacted(api_key, status, caplog):
    caplog.set_level(logging.DEBUG)
    lab = _echoing_lab(status)
    with pytest.raises(LabAuthError) as info:
        await lab.submit({"x": 1}, "k1")
    await lab.aclose()
    message = str(info.value)
    assert f"HTTP {status}" in message and "LABRL_LAB_API_KEY" in message and MASK in message
    assert TOKEN not in message and TOKEN not in caplog.text


async def test_wrong_key_stops_the_lab_env_instead_of_scoring(mock_lab, monkeypatch):
    """Against the real mock lab (a subprocess): a wrong key was invalid_action with reward 0."""
    monkeypatch.setenv("LABRL_WRONG_LAB_KEY", "not-the-token")
    env = make("lab/synthesis-v0", lab_url=mock_lab.url, api_key_env="LABRL_WRONG_LAB_KEY")
    task = env.make_task("train", 0)
    try:
        with pytest.raises(LabAuthError, match="HTTP 403"):
            await run_episode(env, task, scripted_policy(list(env.gold_actions(task))))
    finally:
        await env.close()


@settings(max_examples=80, deadline=None)
@given(
    secret=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=8, max_size=40),
    before=st.text(max_size=60),
    after=st.text(max_size=60),
)
def test_redact_removes_the_secret_wherever_it_appears(secret, before, after):
    for text in (before + secret + after, f'{before}{{"authorization": "Bearer {secret}"}}{after}'):
        assert secret not in redact(text, [secret])


@pytest.mark.parametrize(
    "text",
    [
        "Authorization: Bearer abc123xyz",
        "authorization=Basic dXNlcjpw",
        '"api_key": "sk-live-9"',
        "x-api-key: k9k9k9k9",
    ],
)
def test_redact_masks_unknown_keys_in_credential_fields(text):
    out = redact(text)
    assert out.endswith(MASK) or out.endswith(MASK + '"')
    assert not any(part in out for part in ("abc123xyz", "dXNlcjpw", "sk-live-9", "k9k9k9k9"))


def test_redact_leaves_ordinary_text_alone():
    assert redact("a bearer of bad news; tokens are counted") == "a bearer of bad news; tokens are counted"


ORPHAN_CHECK = textwrap.dedent(
    """
    import asyncio, os, pathlib, sys, tempfile, time
    from labrl.lab_adapters.mock.process import MockLabProcess
    from labrl.lab_adapters.mock.server import MockLabConfig
    from labrl.lab_adapters.rest import RestLabAdapter, RestLabConfig

    recipe = {{"precursors": [{{"formula": "CaCO3", "mmol": 10}}, {{"formula": "TiO2", "mmol": 10}}],
              "temperature_c": 1200, "time_h": 16, "atmosphere": "air"}}
    config = MockLabConfig(state_dir=pathlib.Path(tempfile.mkdtemp()), port=0, latency_median_s=0.01)
    lab = MockLabProcess(config, token={token!r}).start()

    async def one_job():  # a synthesis job runs in the lab's process pool: workers exist now
        async with RestLabAdapter(RestLabConfig(base_url=lab.url)) as client:
            job = await client.submit({{"kind": "synthesis", "recipe": recipe, "sample_seed": 1}}, "k1")
            print("state", (await client.wait(job, 60)).state.value, flush=True)

    asyncio.run(one_job())
    lab.stop()  # SIGTERM
    """
)


def _processes_with(marker: str) -> list[int]:
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker.encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


@pytest.mark.skipif(not pathlib.Path("/proc/self/environ").exists(), reason="needs /proc")
def test_mock_lab_sigterm_leaves_no_pool_workers(tmp_path):
    marker = f"LABRL_ORPHAN_CHECK={uuid.uuid4().hex}"  # inherited by the lab, its forkserver and workers
    env = {**os.environ, "LABRL_LAB_API_KEY": TOKEN, marker.split("=")[0]: marker.split("=")[1]}
    script = ORPHAN_CHECK.format(token=TOKEN)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0 and "state completed" in proc.stdout, proc.stderr
    import time

    deadline = time.monotonic() + 10  # workers told to stop may take a moment to exit
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _processes_with(marker)
    for pid in left:  # do not leak them into the rest of the test run
        os.kill(pid, 9)
    assert left == []
