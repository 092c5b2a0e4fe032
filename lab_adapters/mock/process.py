"""Run the mock lab in a child process (tests, benchmarks, dry runs).

::

    with MockLabProcess(MockLabConfig(state_dir=tmp, port=0), token="t") as lab:
        ...  # lab.url
        lab.restart()                       # same port, same state directory
        lab.stats()                         # the lab's own counts

The child is ``python -m labrl.cli lab serve-mock --config FILE``; the token
reaches it through its environment only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from labrl.errors import LabTransportError
from labrl.lab_adapters.mock.server import MockLabConfig
from labrl.ports import free_restart_port


class MockLabProcess:
    def __init__(self, config: MockLabConfig, token: str, *, startup_timeout_s: float = 30.0) -> None:
        if config.port == 0:
            # restart() comes back on this port: one the kernel never hands out meanwhile
            config = config.model_copy(update={"port": free_restart_port()})
        self.config = config
        self.token = token
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        fd, name = tempfile.mkstemp(prefix="mock-lab-", suffix=".json")
        os.close(fd)
        self._config_path = Path(name)
        self._config_path.write_text(config.model_dump_json())
        self._log_path = Path(name).with_suffix(".log")

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self) -> MockLabProcess:
        env = {**os.environ, self.config.token_env: self.token}
        log = self._log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "labrl.cli", "lab", "serve-mock", "--config", str(self._config_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        # one client for the whole wait: httpx.get() would build a new client (and SSL context) per try
        with httpx.Client(timeout=1.0) as probe:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise LabTransportError(
                        f"mock lab exited with code {self.process.returncode}: {self.log_tail()}"
                    )
                try:
                    if probe.get(self.url + "/healthz").status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        self.stop()
        raise LabTransportError(
            f"mock lab did not come up within {self.startup_timeout_s:g} s: {self.log_tail()}"
        )

    def stop(self, *, kill: bool = False) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def restart(self, *, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()

    def stats(self) -> dict[str, Any]:
        response = httpx.get(
            self.url + "/stats", headers={"Authorization": f"Bearer {self.token}"}, timeout=10
        )
        response.raise_for_status()
        return response.json()

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> MockLabProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._config_path.unlink(missing_ok=True)

    def config_json(self) -> str:
        return json.dumps(self.config.model_dump(mode="json"))
