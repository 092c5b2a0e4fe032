"""Silence the notices megatron-core prints on every CPU run (no TransformerEngine, no Apex).

They say nothing the user can act on, and one of them fires on every forward
pass; real warnings stay visible. Used by the CLI and the test session.

Megatron's "Transformer Engine and Apex are not installed" is filtered only
where CUDA is absent (TE needs CUDA, so it changes nothing there). On a CUDA
machine it stays visible, next to labrl's own line naming the layer spec it
chose and why (``labrl.harness.models.build``).
"""

from __future__ import annotations

import os
import sys
import warnings

# (message regex, category, module regex); no ':' in them, so pytest's ini filters can carry them too
EXPECTED_ON_CPU: tuple[tuple[str, type[Warning], str], ...] = (
    (r"Warning. tp_group is None", DeprecationWarning, r"megatron"),
    (r".*Apex (is|are) not installed", UserWarning, r"megatron"),
    (r"Transformer Engine and Apex are not installed", UserWarning, r"megatron"),
    (r"full scope is deprecated", UserWarning, r"megatron"),
    (r".*", DeprecationWarning, r"megatron\.core\.inference\.contexts"),
    (r".*", DeprecationWarning, r"megatron\.core\.transformer\.multi_latent_attention"),
    (r"`torch\.jit\.script_method` is deprecated", DeprecationWarning, r""),
)
SAYS_WHY_TE_IS_MISSING = r"Transformer Engine and Apex are not installed"


def expected_warnings(cuda: bool | None = None) -> tuple[tuple[str, type[Warning], str], ...]:
    """The filters to install: all of them without CUDA; with CUDA, all but megatron's TE notice."""
    if cuda is None:
        cuda = _cuda_present()
    return tuple(f for f in EXPECTED_ON_CPU if not (cuda and f[0] == SAYS_WHY_TE_IS_MISSING))


def quiet_expected_warnings() -> None:
    for message, category, module in expected_warnings():
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def _cuda_present() -> bool:
    """torch's answer when torch is loaded; else the driver's device node (keeps the CLI's start fast)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.cuda.is_available())
    return os.path.exists("/dev/nvidiactl")
