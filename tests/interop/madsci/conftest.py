"""MADSci nodes on localhost, each a real process: the fixtures of tests/interop/madsci/.

``NodeProcess`` runs a node (``counting_node.py``, or ``labrl lab serve-madsci-node``)
in a scratch working directory (MADSci reads ``settings.yaml``/``.env`` from the
working directory, so a stray file there cannot change the node), waits until
``GET /status`` says ready, and can kill it (SIGKILL, as a crash would) and start it
again on the same port.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from labrl.ports import free_port

HERE = Path(__file__).parent
STARTUP_TIMEOUT_S = 60.0


class NodeProcess:
    def __init__(self, argv: list[str], workdir: Path, port: int) -> None:
        self.argv, self.workdir, self.port = argv, workdir, port
        self.process: subprocess.Popen[bytes] | None = None
        self.log = workdir / "node.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> NodeProcess:
        with self.log.open("ab") as log:
            # own process group: a kill reaches the mock lab a CLI node starts as its child
            self.process = subprocess.Popen(
                self.argv, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with httpx.Client(timeout=2.0) as probe:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"node exited with {self.process.returncode}: {self.log_tail()}")
                try:
                    if probe.get(self.url + "/status").json().get("ready"):
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"node not ready within {STARTUP_TIMEOUT_S:g} s: {self.log_tail()}")

    def stop(self, *, kill: bool = False) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def make_counting_node(tmp_path: Path) -> tuple[NodeProcess, Path]:
    """A ``counting_node.py`` process (not started) and the ledger its actions append to."""
    ledger = tmp_path / "ledger.txt"
    port = free_port()
    argv = [sys.executable, str(HERE / "counting_node.py"), str(port), str(ledger)]
    return NodeProcess(argv, tmp_path, port), ledger


@pytest.fixture(scope="module")
def shared_counting_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeProcess, Path]]:
    node, ledger = make_counting_node(tmp_path_factory.mktemp("counting-node"))
    node.start()
    yield node, ledger
    node.stop()


@pytest.fixture
def counting_node(tmp_path: Path) -> Iterator[tuple[NodeProcess, Path]]:
    """A node of the test's own (not started), for tests that kill and restart it."""
    node, ledger = make_counting_node(tmp_path)
    yield node, ledger
    node.stop()


@pytest.fixture(scope="module")
def mock_lab_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """``labrl lab serve-madsci-node`` as a user runs it: a node in front of a mock lab it starts."""
    workdir = tmp_path_factory.mktemp("mock-lab-node")
    port = free_port()
    argv = [sys.executable, "-m", "labrl.cli", "lab", "serve-madsci-node", "--port", str(port)]
    argv += ["--state-dir", str(workdir / "lab"), "--latency-median", "0.2"]
    node = NodeProcess(argv, workdir, port).start()
    yield node
    node.stop()


@pytest.fixture(autouse=True)
def madsci_files_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """madsci-client writes ``.madsci/logs`` under its settings directory: keep it out of the checkout."""
    monkeypatch.setenv("MADSCI_SETTINGS_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
