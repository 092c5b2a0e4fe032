"""The server supervisor: restarts survive a port still held and a restart that fails.

Uses a stdlib HTTP server as the 'SGLang' process so each case runs in about
a second; the fake SGLang server's end-to-end run is in test_sglang_serve.py.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

import pytest

from labrl.errors import SamplerError
from labrl.harness.samplers.sglang.launch import Supervisor, wait_port_free
from labrl.ports import (
    LINUX_DEFAULT_EPHEMERAL,
    ephemeral_port_range,
    free_port,
    free_restart_port,
    restart_port_warning,
)

# Launch n (counted in a file) behaves as: 1 serves, then dies with code 7 after
# its first health check; 2 dies at once with code 1 (as a bind error would);
# 3 and later serve until stopped.
SERVER = r"""
import http.server, os, sys, threading
counter, port = sys.argv[1], int(sys.argv[2])
with open(counter, "a") as f:
    f.write("x")
n = len(open(counter).read())
if n == 2:
    sys.exit(1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
        if n == 1:
            threading.Timer(0.2, os._exit, (7,)).start()
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_wait_port_free_returns_once_the_listener_closes():
    port = free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    threading.Timer(0.4, holder.close).start()
    waited = wait_port_free("127.0.0.1", port, timeout_s=5, poll_s=0.05)
    assert 0.3 < waited < 5


def test_wait_port_free_times_out_with_a_clear_error():
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        with pytest.raises(SamplerError, match=f"port {port} .* still in use"):
            wait_port_free("127.0.0.1", port, timeout_s=0.3, poll_s=0.05)


def test_a_failed_restart_counts_as_one_and_supervision_goes_on(tmp_path):
    port = free_restart_port()
    cmd = [sys.executable, "-c", SERVER, str(tmp_path / "launches"), str(port)]
    sup = Supervisor(cmd, f"http://127.0.0.1:{port}", ready_timeout_s=20, max_restarts=3, grace_s=5)
    runner = threading.Thread(target=lambda: setattr(sup, "code", sup.run()), daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while not (len(sup.log) >= 5 and sup.log[-1].startswith("ready")):
            assert runner.is_alive(), sup.log
            assert time.monotonic() < deadline, sup.log
            time.sleep(0.05)
        assert sup.log[0].startswith("ready")
        assert sup.log[1] == "exited with code 7; restart 1/3"
        assert sup.log[2].startswith("restart 1 failed: SGLang server exited with code 1 before it was ready")
        assert sup.log[3] == "exited with code 1; restart 2/3"
        assert sup.restarts == 2 and runner.is_alive()
        assert (tmp_path / "launches").read_text() == "xxx"
    finally:
        sup.max_restarts = 0
        sup.stop()
        runner.join(timeout=10)
    assert not runner.is_alive() and sup.code == -15


def test_ephemeral_port_range_reads_the_kernel_file_and_falls_back(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_port_range(str(f)) == (40000, 50000)
    f.write_text("garbage")
    assert ephemeral_port_range(str(f)) == LINUX_DEFAULT_EPHEMERAL
    assert ephemeral_port_range(str(tmp_path / "missing")) == LINUX_DEFAULT_EPHEMERAL


@pytest.mark.parametrize(
    ("port", "warned"),
    [(30000, False), (32767, False), (32768, True), (44819, True), (60999, True), (61000, False)],
)
def test_restart_port_warning_flags_ports_the_kernel_may_hand_out(port, warned):
    warning = restart_port_warning(port, LINUX_DEFAULT_EPHEMERAL)
    assert (warning is not None) == warned
    if warned:
        assert f"port {port}" in warning and "32768-60999" in warning


def test_free_restart_port_is_below_the_ephemeral_range_and_bindable():
    port = free_restart_port()
    assert 20000 <= port < ephemeral_port_range()[0]
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
