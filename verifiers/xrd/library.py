"""The phase library: crystal structures keyed by (reduced formula, space-group number).

Loaded once per process from the shipped ``data/phases.json`` (built offline by
``python -m labrl.verifiers.xrd.build_library``; see that module for sources)
and cached at module level, so env start-up costs one JSON parse (~20 ms).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np

from labrl.errors import ConfigError
from labrl.verifiers.xrd.build_library import LIBRARY_PATH, LIBRARY_VERSION
from labrl.verifiers.xrd.formula import composition_key


@dataclass(frozen=True, eq=False)
class Phase:
    """One crystalline phase. Arrays are read-only views; ``occupancy`` is (N sites, E elements)."""

    id: str
    formula: str
    spacegroup_symbol: str
    spacegroup_number: int
    crystal_system: str
    elements: tuple[str, ...]
    lattice: np.ndarray = field(repr=False)  # (3, 3) rows a, b, c in Å
    frac_coords: np.ndarray = field(repr=False)  # (N, 3)
    occupancy: np.ndarray = field(repr=False)  # (N, E) occupancy of element e on site n
    cell_mass: float  # amu
    volume: float  # Å^3
    source: str
    tags: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def key(self) -> tuple[tuple[tuple[str, float], ...], int]:
        """Matching key: (canonical reduced composition, space-group number)."""
        return composition_key(self.formula), self.spacegroup_number

    @property
    def abc(self) -> tuple[float, float, float]:
        a, b, c = np.linalg.norm(self.lattice, axis=1)
        return float(a), float(b), float(c)

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "formula": self.formula,
            "space_group": self.spacegroup_symbol,
            "space_group_number": self.spacegroup_number,
            "crystal_system": self.crystal_system,
            "abc": [round(x, 4) for x in self.abc],
            "source": self.source,
        }

    def to_pymatgen(self) -> Any:
        """The pymatgen Structure (for cross-checks; imports pymatgen)."""
        from pymatgen.core import Lattice, Structure

        species = [
            {el: float(occ) for el, occ in zip(self.elements, row, strict=True) if occ > 0}
            for row in self.occupancy
        ]
        return Structure(Lattice(self.lattice), species, self.frac_coords)


def _phase_from_record(record: dict[str, Any]) -> Phase:
    elements = tuple(record["elements"])
    index = {el: i for i, el in enumerate(elements)}
    occupancy = np.zeros((len(record["sites"]), len(elements)))
    for n, site in enumerate(record["sites"]):
        for el, occ in site["species"].items():
            occupancy[n, index[el]] = occ
    arrays = [
        np.asarray(record["lattice"], dtype=float),
        np.asarray([s["frac"] for s in record["sites"]]),
        occupancy,
    ]
    for arr in arrays:
        arr.setflags(write=False)
    return Phase(
        id=record["id"],
        formula=record["formula"],
        spacegroup_symbol=record["spacegroup_symbol"],
        spacegroup_number=int(record["spacegroup_number"]),
        crystal_system=record["crystal_system"],
        elements=elements,
        lattice=arrays[0],
        frac_coords=arrays[1],
        occupancy=arrays[2],
        cell_mass=float(record["cell_mass"]),
        volume=float(record["volume"]),
        source=record["source"],
        tags=record.get("tags", {}),
    )


class PhaseLibrary:
    """All phases, with lookups by id, by matching key and by element set."""

    def __init__(self, phases: list[Phase]):
        self.phases: tuple[Phase, ...] = tuple(phases)
        self._by_id = {p.id: p for p in self.phases}
        self._by_key = {p.key: p for p in self.phases}
        self._by_composition: dict[Any, list[Phase]] = {}
        for p in self.phases:
            self._by_composition.setdefault(p.key[0], []).append(p)
        if len(self._by_id) != len(self.phases) or len(self._by_key) != len(self.phases):
            raise ConfigError("phase library has duplicate ids or (formula, space group) keys: rebuild it")

    def __len__(self) -> int:
        return len(self.phases)

    def __iter__(self):
        return iter(self.phases)

    def __contains__(self, phase_id: object) -> bool:
        return phase_id in self._by_id

    def get(self, phase_id: str) -> Phase:
        try:
            return self._by_id[phase_id]
        except KeyError:
            raise ConfigError(f"unknown phase id {phase_id!r}") from None

    def by_key(self, key: tuple[Any, int]) -> Phase | None:
        return self._by_key.get(key)

    def by_formula(self, formula: str) -> list[Phase]:
        """Phases whose reduced composition equals ``formula``'s (any space group)."""
        return list(self._by_composition.get(composition_key(formula), []))

    def search(self, elements: list[str] | tuple[str, ...], *, exact: bool = False) -> list[Phase]:
        """Phases made only of ``elements`` (all of them when ``exact``), ordered by id."""
        wanted = set(elements)
        if exact:
            return [p for p in self.phases if set(p.elements) == wanted]
        return [p for p in self.phases if set(p.elements) <= wanted]


@cache
def load_library() -> PhaseLibrary:
    """The shipped phase library (parsed once per process)."""
    if not LIBRARY_PATH.exists():
        raise ConfigError(f"{LIBRARY_PATH} is missing: run `python -m labrl.verifiers.xrd.build_library`")
    data = json.loads(LIBRARY_PATH.read_text())
    if data.get("version") != LIBRARY_VERSION:
        raise ConfigError(
            f"{LIBRARY_PATH} has version {data.get('version')}, expected {LIBRARY_VERSION}: "
            "run `python -m labrl.verifiers.xrd.build_library`"
        )
    return PhaseLibrary([_phase_from_record(r) for r in data["phases"]])


def is_held_out(phase_id: str, fraction: float) -> bool:
    """Deterministic hash split of phases: True for about ``fraction`` of ids (stable across runs)."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"xrd-holdout:{phase_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction
