"""Fixtures for the SGLang tests; helpers live in sglang_toy.py (importable: this folder is put on sys.path)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

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
