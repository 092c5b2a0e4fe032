"""The mock lab served by uvicorn in a thread on a real loopback socket (a lab that outlives a run)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from labrl.lab_adapters.mock.server import MockLabConfig, create_app
from labrl.ports import free_port


@contextmanager
def serve_mock_lab(
    state_dir: Path, *, latency_median_s: float, latency_sigma: float = 0.2
) -> Iterator[tuple[str, object]]:
    """``(url, asgi app)``; the caller sets ``LABRL_MOCK_LAB_TOKEN`` (the lab demands it)."""
    import uvicorn

    asgi = create_app(
        MockLabConfig(state_dir=state_dir, latency_median_s=latency_median_s, latency_sigma=latency_sigma)
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(asgi, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(400):
        if server.started:
            break
        threading.Event().wait(0.025)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}", asgi
    finally:
        server.should_exit = True
        thread.join(timeout=10)
