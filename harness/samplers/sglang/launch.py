"""Launch and supervise an SGLang server process (``labrl serve sglang``).

``server_command`` adds the flags labrl needs unless the user already gave
them: ``--enable-return-routed-experts`` (router replay needs the rows),
``--weight-version 0`` (labrl tags tokens with integer versions; SGLang's
default is the string ``"default"``) and, when determinism is asked for,
``--enable-deterministic-inference`` (without it SGLang ignores
``sampling_seed``).

SGLang pins its own torch (and CUDA wheels), so it runs from its own
interpreter: ``launcher_for(python)`` is ``PYTHON -m sglang.launch_server``
and ``check_server_python`` asks that interpreter for its SGLang version
first, so a wrong path fails with a clear message instead of a crash loop.
The learner's environment never imports sglang. ``Supervisor`` starts the process in
its own process group, waits for ``GET /health_generate`` to answer 200,
restarts it when it dies (up to ``max_restarts``), and stops it (SIGTERM,
then SIGKILL after a grace period) on exit. Before a restart it kills what is
left of the dead server's process group and waits for the port to be free
(a dying child can still hold the listening socket); a restart that fails to
come up counts as one of the ``max_restarts`` rather than ending supervision.
A restart reuses the port clients know, so a port inside the kernel's
ephemeral range (``labrl.ports``) can be taken by any process's
outgoing connection or ``bind(0)`` while the server is down; SGLang's
default, 30000, lies below Linux's default range and ``labrl serve`` warns
about one inside it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from labrl.errors import ConfigError, SamplerError

DEFAULT_LAUNCHER = f"{shlex.quote(sys.executable)} -m sglang.launch_server"


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def launcher_for(python: str) -> str:
    """The launcher of an SGLang installed in another environment: ``PYTHON -m sglang.launch_server``."""
    return f"{shlex.quote(python)} -m sglang.launch_server"


def check_server_python(python: str, timeout_s: float = 120.0) -> str:
    """The SGLang version importable by ``python``; a clear error when there is none."""
    try:
        done = subprocess.run(
            [python, "-c", "import sglang; print(sglang.__version__)"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except FileNotFoundError:
        raise SamplerError(f"--python {python}: no such interpreter") from None
    except subprocess.TimeoutExpired:
        raise SamplerError(f"--python {python}: 'import sglang' took over {timeout_s:.0f} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        raise SamplerError(
            f"--python {python} cannot import sglang ({last}): point it at the interpreter of the "
            "environment SGLang is installed in (e.g. /opt/sglang/bin/python)"
        )
    return done.stdout.strip()


def server_command(
    model: str,
    host: str,
    port: int,
    extra: Sequence[str],
    launcher: str = DEFAULT_LAUNCHER,
    *,
    deterministic: bool = False,
    tp_size: int | None = None,
) -> list[str]:
    cmd = [*shlex.split(launcher), "--model-path", model, "--host", host, "--port", str(port)]
    if not _has_flag(extra, "--enable-return-routed-experts"):
        cmd.append("--enable-return-routed-experts")
    if not _has_flag(extra, "--weight-version"):
        cmd += ["--weight-version", "0"]
    if deterministic and not _has_flag(extra, "--enable-deterministic-inference"):
        cmd.append("--enable-deterministic-inference")
    if tp_size is not None and not _has_flag(extra, "--tp-size"):
        cmd += ["--tp-size", str(tp_size)]
    return cmd + list(extra)


def launch_command(cfg: Any) -> list[str]:
    """The server command of a ``sampler.sglang`` block (``SGLangSamplerConfig``): at ``urls[0]``."""
    from urllib.parse import urlsplit

    missing = [k for k in ("launch_python", "launch_model_path") if getattr(cfg, k) is None]
    if missing:
        raise ConfigError(f"sampler.sglang.{missing[0]} is not set: the launched server needs it")
    url = urlsplit(cfg.urls[0])
    if url.hostname is None or url.port is None:
        raise ConfigError(
            f"sampler.sglang.urls[0]={cfg.urls[0]!r} needs a host and a port to launch a server at"
        )
    return server_command(
        cfg.launch_model_path,
        url.hostname,
        url.port,
        list(cfg.launch_args),
        launcher_for(cfg.launch_python),
        deterministic=cfg.deterministic_inference,
        tp_size=cfg.launch_tp_size,
    )


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, poll_s: float = 0.5) -> float:
    """Block until ``/health_generate`` answers 200; returns the seconds waited."""
    start = time.monotonic()
    while True:
        code = proc.poll()
        if code is not None:
            raise SamplerError(f"SGLang server exited with code {code} before it was ready")
        try:
            if httpx.get(url + "/health_generate", timeout=min(10.0, timeout_s)).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        if time.monotonic() - start > timeout_s:
            raise SamplerError(f"SGLang server at {url} not ready after {timeout_s:.0f} s")
        time.sleep(poll_s)


def wait_port_free(host: str, port: int, timeout_s: float, poll_s: float = 0.1) -> float:
    """Block until ``(host, port)`` can be bound again; returns the seconds waited.

    Binds with ``SO_REUSEADDR`` as servers do, so connections in TIME_WAIT do
    not count as busy: only a socket still listening (a child of a killed
    server not yet reaped) does.
    """
    start = time.monotonic()
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
                return time.monotonic() - start
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
        if time.monotonic() - start > timeout_s:
            raise SamplerError(f"port {port} on {host} still in use {timeout_s:.0f} s after the server died")
        time.sleep(poll_s)


@dataclass
class Supervisor:
    command: list[str]
    url: str
    ready_timeout_s: float = 900.0
    max_restarts: int = 3
    grace_s: float = 15.0
    log: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    restarts: int = 0

    def start(self) -> float:
        self.proc = subprocess.Popen(self.command, start_new_session=True)
        try:
            waited = wait_ready(self.url, self.proc, self.ready_timeout_s)
        except SamplerError:
            self.stop()
            raise
        self.log.append(f"ready in {waited:.1f} s (pid {self.proc.pid})")
        return waited

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=self.grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=self.grace_s)

    def run(self) -> int:
        """Start, then restart on unexpected exits; returns the last exit code (0 on a clean stop)."""
        self.start()
        assert self.proc is not None
        while True:
            code = self.proc.wait()
            if code == 0:
                return 0
            if self.restarts >= self.max_restarts:
                self.log.append(f"exited with code {code}; no restarts left")
                return code
            self.restarts += 1
            self.log.append(f"exited with code {code}; restart {self.restarts}/{self.max_restarts}")
            print(f"labrl serve: server exited with code {code}, restarting", file=sys.stderr)
            self._kill_group()
            try:
                url = urlsplit(self.url)
                wait_port_free(url.hostname or "127.0.0.1", url.port or 80, self.grace_s)
                self.start()
            except SamplerError as exc:
                # the loop's next wait() returns the failed attempt's code at once
                self.log.append(f"restart {self.restarts} failed: {exc}")
                print(f"labrl serve: restart {self.restarts} failed: {exc}", file=sys.stderr)

    def _kill_group(self) -> None:
        """SIGKILL what is left of the last server's process group (its leader is gone)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
            os.killpg(self.proc.pid, signal.SIGKILL)
