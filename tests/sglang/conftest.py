"""Fixtures for the SGLang tests; helpers live in sglang_toy.py (importable: this folder is on pytest's pythonpath)."""

from __future__ import annotations

import pytest
from sglang_pipeline_check import parity_env  # noqa: F401 (a fixture, shared with tests/gpu)

from labrl.testing.fake_sglang_server import FakeSGLangServer, ServerThread


@pytest.fixture
def served():
    """Start fake servers in threads: ``served(server) -> url``; all stopped at teardown."""
    threads: list[ServerThread] = []

    def start(server: FakeSGLangServer) -> str:
        thread = ServerThread(server.app)
        threads.append(thread)
        return thread.start()

    start.threads = threads
    yield start
    for t in threads:
        t.stop()
