"""The simulated lab behind the mock server: what a job *does*.

Job kinds (``request["kind"]``):

- ``echo``: returns ``{"echo": payload, "digest": sha256(payload)}``; the
  reliability tests and the benchmark use it to check that every result
  belongs to its request.
- ``calculation``: an ASE calculation (``labrl.lab_adapters.calculators``);
  this is the "remote calculator" backend of the simulator envs.
- ``synthesis``: a solid-state synthesis followed by an XRD measurement
  (``labrl.lab_adapters.mock.chemistry``), available when ``labrl.verifiers.xrd``
  is installed.

``validate(request)`` runs at submit time (a malformed request is refused
with HTTP 422 and never queued); ``execute(request, seed)`` runs when the
job's latency has elapsed, in a worker process for the heavy kinds.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from labrl.errors import ConfigError
from labrl.lab_adapters.calculators import execute_calculation, validate_calculation


def _synthesis_module() -> Any:
    from labrl.lab_adapters.mock import chemistry

    return chemistry


def kinds() -> tuple[str, ...]:
    try:
        _synthesis_module()
    except ImportError:
        return ("echo", "calculation")
    return ("echo", "calculation", "synthesis")


def validate(request: dict[str, Any]) -> None:
    """Refuse a malformed request with a ``LabrlError`` naming the problem."""
    kind = request.get("kind")
    if kind not in kinds():
        raise ConfigError(f"unknown job kind {kind!r}; this lab runs {', '.join(kinds())}")
    if kind == "echo":
        if "payload" not in request:
            raise ConfigError('an echo job needs a "payload"')
    elif kind == "calculation":
        validate_calculation(request)
    else:
        _synthesis_module().validate_synthesis_request(request)


def is_heavy(request: dict[str, Any]) -> bool:
    return request.get("kind") != "echo"


def execute(request: dict[str, Any], seed: int) -> dict[str, Any]:
    """Run one validated job (module docstring); module-level so it can run in a worker process."""
    kind = request["kind"]
    if kind == "echo":
        payload = request["payload"]
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
        return {"echo": payload, "digest": digest}
    if kind == "calculation":
        return execute_calculation(request)
    return _synthesis_module().run_synthesis(request, seed)
