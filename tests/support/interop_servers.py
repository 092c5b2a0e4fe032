"""What the protocol servers' tests share (tests/interop/*): a ``labrl ... serve`` command run as a
real subprocess on a free port, its health wait, the commands of a docs/interop.md section,
which the tests run as written, and ``benchmarks/serve.py`` imported as its script imports it."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from labrl.ports import free_port

DOCS = Path(__file__).parents[2] / "docs" / "interop.md"
BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
STARTUP_TIMEOUT_S = 120.0  # the xrd envs load their phase library before the server answers


def wait_healthy(url: str, process: subprocess.Popen[str] | None = None) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}: {process.stderr.read()}")  # type: ignore[union-attr]
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no healthy server at {url} within {STARTUP_TIMEOUT_S:g} s")


@contextmanager
def serve_argv(argv: list[str], env: Mapping[str, str] | None = None) -> Iterator[str]:
    """``labrl ARGV`` (a serve command) as a subprocess, its ``--port`` replaced by a free port.

    stdout is discarded (a server may log every request there; a full pipe would block it)."""
    port = free_port()
    if "--port" in argv:
        at = argv.index("--port")
        argv = argv[:at] + argv[at + 2 :]
    process = subprocess.Popen(
        [sys.executable, "-m", "labrl.cli", *argv, "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})}, cwd=Path(__file__).parent,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextmanager
def serve_app_in_thread(app: Any) -> Iterator[str]:
    """``app`` under uvicorn in a thread of this process, on a free port; yields its URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def registered(entry_points: Mapping[str, str]) -> Iterator[None]:
    """Env ids registered (id -> ``module:Class``) for the block, deregistered after it."""
    from labrl.envs.registry import deregister, register

    for env_id, entry_point in entry_points.items():
        register(env_id, entry_point)
    try:
        yield
    finally:
        for env_id in entry_points:
            deregister(env_id)


def docs_section(heading: str) -> str:
    """The docs/interop.md section under ``heading`` (e.g. ``"## OpenEnv"``), to the next ``## ``."""
    text = DOCS.read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def docs_serve_command(heading: str) -> list[str]:
    """The section's ``labrl envs serve ...`` line, split into its arguments after ``labrl``."""
    (line,) = [line for line in docs_section(heading).splitlines() if line.startswith("labrl envs serve ")]
    return line.split()[1:]


def docs_python_block(heading: str) -> str:
    section = docs_section(heading)
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


def serve_benchmark() -> ModuleType:
    """``benchmarks/serve.py`` as a module; benchmarks/ goes on ``sys.path`` (last) because the script
    imports its helpers beside it by name, as ``python benchmarks/serve.py`` lets it."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    return importlib.import_module("serve")
