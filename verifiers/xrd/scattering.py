"""Atomic X-ray scattering factors, read at run time from pymatgen's installed data.

pymatgen's ``XRDCalculator`` uses, per element, four (a_i, b_i) pairs in::

    f(s) = Z - 41.78214 · s² · Σ_i a_i · exp(-b_i · s²),    s = sin θ / λ

We read the same table from pymatgen's installed package data
(``pymatgen/analysis/diffraction/atomic_scattering_params.json``) without
importing pymatgen (locating the file costs nothing), so the two simulators
agree by construction and nothing is copied into labrl. Atomic numbers and
masses come from ``ase.data``.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from labrl.errors import ConfigError

#: Cu Kα wavelengths in Å, the values pymatgen's WAVELENGTHS table uses
CU_KA = 1.54184
CU_KA1 = 1.54056
CU_KA2 = 1.54439


def pymatgen_scattering_file() -> Path:
    spec = importlib.util.find_spec("pymatgen")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "labrl.verifiers.xrd needs pymatgen installed (its scattering-factor table is read at run time)"
        )
    path = (
        Path(next(iter(spec.submodule_search_locations)))
        / "analysis"
        / "diffraction"
        / "atomic_scattering_params.json"
    )
    if not path.exists():
        raise ConfigError(f"pymatgen's scattering table is missing at {path}: reinstall pymatgen")
    return path


@dataclass(frozen=True)
class ScatteringTable:
    params: dict[str, np.ndarray]  # symbol -> (4, 2) [a_i, b_i], zero-padded
    z: dict[str, int]
    mass: dict[str, float]  # amu

    def coefficients(self, elements: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(Z (E,), coeff (E, 4, 2))`` for ``elements``."""
        missing = [el for el in elements if el not in self.params]
        if missing:
            raise ConfigError(f"no X-ray scattering coefficients for {missing}")
        return np.array([self.z[el] for el in elements], dtype=float), np.stack(
            [self.params[el] for el in elements]
        )


@cache
def scattering_table() -> ScatteringTable:
    from ase.data import atomic_masses, atomic_numbers

    raw = json.loads(pymatgen_scattering_file().read_text())
    params = {}
    for symbol, rows in raw.items():
        arr = np.zeros((4, 2))
        arr[: len(rows)] = np.asarray(rows, dtype=float)
        params[symbol] = arr
    z = {s: int(atomic_numbers[s]) for s in params if s in atomic_numbers}
    mass = {s: float(atomic_masses[z[s]]) for s in z}
    return ScatteringTable(params={s: p for s, p in params.items() if s in z}, z=z, mass=mass)
