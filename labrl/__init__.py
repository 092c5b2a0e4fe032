"""labrl: a gym of high-latency scientific environments and an async RL harness.

Public surface: the Env contract and registry (``labrl.envs``), reward
functions (``labrl.verifiers``), lab clients (``labrl.lab_adapters``) and the
RL harness (``labrl.harness``). See docs/architecture.md for the layout.
"""

from labrl import errors
from labrl.errors import ConfigError, LabrlError

__version__ = "0.1.0"

__all__ = ["ConfigError", "LabrlError", "__version__", "errors"]
