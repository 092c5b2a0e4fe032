"""The phase library: crystal structures with ids, sources and citations.

Two shipped versions, each parsed once per process (built offline by
``python -m labrl.verifiers.xrd.build_library``; see that module for sources):

- ``v0`` (``data/phases.json``): ids ``formula_sg``, what ``xrd/phase-id-v0``
  tasks are drawn from; frozen.
- ``v1`` (``data/phases_v1.json``): ids ``formula_sg_pearson`` (``Si_227_cF8``
  diamond, ``Si_227_cF136`` clathrate), the curated common phases first, each
  entry marked experimental or hypothetical with its citation.

``load_library(version, extra_cifs=[...])`` adds the user's CIF files (or
folders of them) at run time: each is parsed, validated and compared with the
library by pymatgen's ``StructureMatcher``; one that matches a library phase
is not added twice. ``resolve_phase(id)`` finds a phase of any loaded library
(v0 and v1 ids never collide: v1 ids have three parts).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import numpy as np

from labrl.errors import ConfigError, StructureFileError
from labrl.verifiers.xrd.formula import composition_key
from labrl.verifiers.xrd.phase_records import (
    LIBRARY_V0_FORMAT,
    LIBRARY_V0_PATH,
    LIBRARY_V1_FORMAT,
    LIBRARY_V1_PATH,
    merge_unique,
    phase_record_v1,
)


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
    experimental: bool = True  # False: a hypothetical structure (v0: the substitutions)
    citation: str = field(default="", repr=False)
    name: str = ""  # common or mineral name where known (v1)

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
        experimental=bool(record.get("experimental", record["source"] != "substitution")),
        citation=record.get("citation", ""),
        name=record.get("name", ""),
    )


class PhaseLibrary:
    """All phases, with lookups by id, by matching key and by element set."""

    def __init__(self, phases: list[Phase]):
        self.phases: tuple[Phase, ...] = tuple(phases)
        self._by_id = {p.id: p for p in self.phases}
        self._by_key: dict[Any, Phase] = {}
        self._by_composition: dict[Any, list[Phase]] = {}
        for p in self.phases:
            self._by_key.setdefault(p.key, p)  # polymorphs sharing a space group (v1): the first listed
            self._by_composition.setdefault(p.key[0], []).append(p)
        if len(self._by_id) != len(self.phases):
            raise ConfigError("phase library has duplicate ids: rebuild it")

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

    def experimental(self) -> list[Phase]:
        """The phases from experimental structures (not the hypothetical ones)."""
        return [p for p in self.phases if p.experimental]

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


LibraryVersion = Literal["v0", "v1"]
_FILES = {"v0": (LIBRARY_V0_PATH, LIBRARY_V0_FORMAT), "v1": (LIBRARY_V1_PATH, LIBRARY_V1_FORMAT)}
_USER_PHASES: dict[str, Phase] = {}  # user CIF phases of this process, by id (for resolve_phase)


@cache
def _shipped(version: LibraryVersion) -> PhaseLibrary:
    if version not in _FILES:
        raise ConfigError(f"unknown phase-library version {version!r}: use one of {sorted(_FILES)}")
    path, expected = _FILES[version]
    flag = "" if version == "v0" else f" --version {version}"
    if not path.exists():
        raise ConfigError(f"{path} is missing: run `python -m labrl.verifiers.xrd.build_library{flag}`")
    data = json.loads(path.read_text())
    if data.get("version") != expected:
        raise ConfigError(
            f"{path} has version {data.get('version')}, expected {expected}: "
            f"run `python -m labrl.verifiers.xrd.build_library{flag}`"
        )
    return PhaseLibrary([_phase_from_record(r) for r in data["phases"]])


def load_library(version: LibraryVersion = "v0", extra_cifs: Iterable[str | Path] = ()) -> PhaseLibrary:
    """The shipped library ``version`` (parsed once per process), plus the phases of ``extra_cifs``.

    ``extra_cifs`` are CIF files or folders (every ``*.cif`` inside, sorted).
    A CIF structure matching a library phase (``StructureMatcher``) is not
    added; one matching nothing gets an id by the v1 scheme and
    ``source="user"``. Bad files raise ``StructureFileError``.
    """
    base = _shipped(version)
    paths = cif_paths(extra_cifs)
    if not paths:
        return base
    return add_cif_phases(base, paths)


def cif_paths(items: Iterable[str | Path]) -> list[Path]:
    """Files and the ``*.cif`` files of folders, in the given order (folders sorted)."""
    out: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".cif")
            if not found:
                raise StructureFileError(f"{path}: folder holds no .cif files")
            out += found
        elif path.is_file():
            out.append(path)
        else:
            raise StructureFileError(f"{path}: no such CIF file or folder")
    return out


def read_cif(path: str | Path) -> list[Any]:
    """The ordered or disordered pymatgen Structures of a CIF; ``StructureFileError`` if none parse."""
    import warnings

    from pymatgen.io.cif import CifParser

    path = Path(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            structures = CifParser(path).parse_structures(primitive=False)
    except (ValueError, KeyError, IndexError, TypeError, AssertionError) as exc:
        raise StructureFileError(f"{path}: not a readable CIF ({type(exc).__name__}: {exc})") from None
    if not structures:
        raise StructureFileError(f"{path}: the CIF holds no structure pymatgen can build")
    for structure in structures:
        total = [sum(site.species.values()) for site in structure]
        if any(t > 1.0 + 1e-3 for t in total):
            raise StructureFileError(f"{path}: a site has total occupancy {max(total):.3f} > 1")
        if structure.lattice.volume <= 1.0:
            raise StructureFileError(f"{path}: cell volume {structure.lattice.volume:.3g} Å^3")
    return structures


def add_cif_phases(library: PhaseLibrary, paths: Iterable[str | Path]) -> PhaseLibrary:
    """``library`` plus the CIF structures not matching one of its phases (see ``load_library``)."""
    return cif_phases(library, paths)[0]


def cif_phases(library: PhaseLibrary, paths: Iterable[str | Path]) -> tuple[PhaseLibrary, list[Phase]]:
    """(``library`` plus the new CIF phases, the phase of every CIF structure in file order).

    A structure matching a library phase (or an earlier CIF's) is that phase, not a new one:
    the list tells the caller which phases the user asked for either way.
    """
    records: list[dict[str, Any]] = []
    for path in paths:
        for n, structure in enumerate(read_cif(path)):
            try:
                record = phase_record_v1(
                    structure,
                    source="user",
                    experimental=True,
                    citation=f"user CIF {Path(path).name}" + (f" (block {n + 1})" if n else ""),
                    name=Path(path).stem,
                )
            except ConfigError as exc:
                raise StructureFileError(f"{path}: {exc}") from None
            records.append(record)
    existing = [_record_of(p) for p in library]
    matched: list[str] = []
    merged = merge_unique(records, existing=existing, matched=matched)
    added = [_phase_from_record(r) for r in merged[len(existing) :]]
    for phase in added:
        _USER_PHASES[phase.id] = phase
    extended = PhaseLibrary([*library.phases, *added]) if added else library
    return extended, [extended.get(pid) for pid in matched]


def _record_of(phase: Phase) -> dict[str, Any]:
    """The record fields ``merge_unique`` compares (id, formula, lattice, sites)."""
    return {
        "id": phase.id,
        "formula": phase.formula,
        "lattice": phase.lattice.tolist(),
        "sites": [
            {"species": {el: float(o) for el, o in zip(phase.elements, row, strict=True) if o > 0}, "frac": f}
            for row, f in zip(phase.occupancy, phase.frac_coords.tolist(), strict=True)
        ],
    }


def resolve_phase(phase_id: str) -> Phase:
    """The phase ``phase_id`` of v0, v1 or a user CIF loaded in this process."""
    for version in ("v0", "v1"):
        library = _shipped(version)
        if phase_id in library:
            return library.get(phase_id)
    if phase_id in _USER_PHASES:
        return _USER_PHASES[phase_id]
    raise ConfigError(f"unknown phase id {phase_id!r}")


def is_held_out(phase_id: str, fraction: float) -> bool:
    """Deterministic hash split of phases: True for about ``fraction`` of ids (stable across runs)."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"xrd-holdout:{phase_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction
