"""The xrd tools env served by docs/interop.md's ORS command; the SDK never asks PyPI for updates."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

pytest.importorskip("openreward")

os.environ["OPENREWARD_DISABLE_UPDATE_CHECK"] = "1"  # before any client exists; servers inherit it

from interop_servers import registered, serve_argv
from ors_servers import docs_serve_command


@pytest.fixture(scope="module")
def xrd_server() -> Iterator[str]:
    with serve_argv(docs_serve_command()) as url:  # docs/interop.md's command, on a free port
        yield url


@pytest.fixture(scope="module")
def fixture_envs() -> Iterator[None]:
    ids = {
        "test/echo-v0": "labrl_test_envs:EchoEnv",
        "test/slow-v0": "labrl_test_envs:SlowEnv",
        "test/crashing-v0": "labrl_test_envs:CrashingEnv",
        "test/broken-verifier-v0": "labrl_test_envs:BrokenVerifierEnv",
    }
    with registered(ids):
        yield
