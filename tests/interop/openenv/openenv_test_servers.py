"""Real OpenEnv servers on localhost: ``labrl envs serve`` as a subprocess, or the same app under
uvicorn in a thread (for the fixture envs that only the test process registers)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

pytest.importorskip("openenv")

from labrl.lab_adapters.mock.process import free_port

DOCS = Path(__file__).parents[3] / "docs" / "interop.md"
STARTUP_TIMEOUT_S = 120.0  # the xrd envs load their phase library while the manifest is built


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
def serve_cli(env_id: str, *args: str, env: Mapping[str, str] | None = None) -> Iterator[str]:
    """``labrl envs serve ENV_ID --protocol openenv`` as a subprocess on a free port; yields its URL."""
    with serve_argv(["envs", "serve", env_id, "--protocol", "openenv", *args], env=env) as url:
        yield url


@contextmanager
def serve_argv(argv: list[str], env: Mapping[str, str] | None = None) -> Iterator[str]:
    """``labrl ARGV`` (a serve command) as a subprocess, its ``--port`` replaced by a free port."""
    port = free_port()
    if "--port" in argv:
        at = argv.index("--port")
        argv = argv[:at] + argv[at + 2 :]
    command = [sys.executable, "-m", "labrl.cli", *argv, "--port", str(port)]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
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
def serve_in_thread(env_id: str, **options: object) -> Iterator[str]:
    """The OpenEnv app of ``env_id`` under uvicorn in a thread of this process; yields its URL."""
    import uvicorn

    from labrl.interop.servers import ServeSettings, app_factory

    port = free_port()
    app = app_factory("openenv")(ServeSettings(env_id=env_id, options=dict(options), tasks_per_split=5))
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


def docs_section() -> str:
    """docs/interop.md's OpenEnv section, whose commands the tests run as written."""
    text = DOCS.read_text()
    start = text.index("## OpenEnv")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def docs_serve_command() -> list[str]:
    """The documented ``labrl envs serve ...`` line, split into its arguments after ``labrl``."""
    (line,) = [line for line in docs_section().splitlines() if line.startswith("labrl envs serve ")]
    return line.split()[1:]


def docs_python_block() -> str:
    section = docs_section()
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]
