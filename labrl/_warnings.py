"""Silence the notices megatron-core prints on every CPU run (no TransformerEngine, no Apex).

They say nothing the user can act on, and one of them fires on every forward
pass; real warnings stay visible. Used by the CLI and the test session.
"""

from __future__ import annotations

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


def quiet_expected_warnings() -> None:
    # Python hides DeprecationWarning outside __main__; labrl's own (keys and names that moved) are
    # meant for the user of the CLI. Added first so the specific "ignore" filters below take precedence.
    warnings.filterwarnings("default", category=DeprecationWarning, module=r"labrl(\.|$)")
    for message, category, module in EXPECTED_ON_CPU:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
