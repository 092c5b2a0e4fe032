"""Deprecated: CIF files are read by ``labrl.verifiers.xrd.library`` (one reader for identify and the library).

``phase_from_cif(path)`` is kept for one release; use
``library.cif_phases(library, [path])`` or ``load_library(version, extra_cifs=[path])``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from labrl.verifiers.xrd.library import Phase, PhaseLibrary, cif_paths, cif_phases


def phase_from_cif(path: str | Path) -> Phase:
    """The first structure in ``path`` as a ``Phase`` (v1 id, ``source="user"``); deprecated."""
    warnings.warn(
        "labrl.verifiers.xrd.cif.phase_from_cif is deprecated: use "
        "labrl.verifiers.xrd.library.cif_phases or load_library(extra_cifs=...)",
        DeprecationWarning,
        stacklevel=2,
    )
    return cif_phases(PhaseLibrary([]), cif_paths([path]))[1][0]
