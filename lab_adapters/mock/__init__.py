"""labrl.lab_adapters.mock: the mock autonomous lab, a real HTTP server for tests, dry runs and CI.

- ``server``: the FastAPI app (``create_app``, ``serve``; ``labrl lab serve-mock``),
  ``InProcessMockLab`` behind ``httpx.ASGITransport``, injectable faults (``FaultConfig``);
- ``store``: its job store (memory, written through to SQLite: survives restarts);
- ``process``: ``MockLabProcess``, the server in a child process;
- ``simlab``: what a job does (``echo``, ``calculation``, ``synthesis``);
- ``chemistry``: the hidden chemistry of ``synthesis`` jobs (what the mock's furnace
  makes of a recipe, and the XRD pattern it measures).

Import direction: the mock depends on the public lab contracts
(``labrl.lab_adapters.protocol``, ``labrl.lab_adapters.recipes``); no real adapter and no
env imports it at module level (``tests/package/test_package.py``). The lab envs start it
only as their offline default, when no ``lab_url`` is given (``labrl.envs.lab.session``).
"""

from labrl.lab_adapters.mock.process import MockLabProcess
from labrl.lab_adapters.mock.server import FaultConfig, InProcessMockLab, MockLabConfig, create_app, serve

__all__ = [
    "FaultConfig",
    "InProcessMockLab",
    "MockLabConfig",
    "MockLabProcess",
    "create_app",
    "serve",
]
