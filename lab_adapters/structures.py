"""Crystal structures as the model writes them, validated, and their canonical hash.

The JSON a model writes (and the tools return)::

    {"lattice": [[3.6, 0, 0], [0, 3.6, 0], [0, 0, 3.6]],      # rows are cell vectors, Å
     "species": ["Cu", "Cu", "Cu", "Cu"],
     "frac_coords": [[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]]}

``lattice`` may also be ``[a, b, c, alpha, beta, gamma]`` (Å, degrees).

``parse_structure`` refuses, with ``InvalidActionError`` and a message the
model can act on: non-numeric or non-finite numbers, unknown elements,
mismatched lengths, more than ``max_atoms`` atoms, a cell of absurd volume
(outside ``[MIN_VOLUME_PER_ATOM, MAX_VOLUME_PER_ATOM]`` Å³ per atom) and
overlapping atoms (any periodic distance below ``MIN_DISTANCE`` Å).

``structure_hash`` is the cache key for calculator results: invariant to the
order of the atoms and to fractional coordinates wrapped by whole cell
vectors, sensitive to anything that changes the energy beyond the rounding
(1e-5 in fractional coordinates, 1e-5 Å in the cell).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import numpy as np
from ase import Atoms
from ase.data import chemical_symbols
from ase.geometry import cellpar_to_cell, get_distances

from labrl.errors import InvalidActionError
from labrl.untrusted_text import UntrustedJSONError, loads

MIN_DISTANCE = 0.7  # Å: closer than any bond; the calculators diverge below it
MIN_VOLUME_PER_ATOM = 2.0  # Å^3
MAX_VOLUME_PER_ATOM = 200.0  # Å^3
_ELEMENTS = frozenset(chemical_symbols[1:])


def _numbers(value: Any, what: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    try:
        array = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        raise InvalidActionError(f"{what} must contain only numbers") from None
    if shape is not None and array.shape != shape:
        raise InvalidActionError(f"{what} must have shape {list(shape)}, got {list(array.shape)}")
    if not np.all(np.isfinite(array)):
        raise InvalidActionError(f"{what} contains a non-finite number")
    return array


def parse_structure(data: Any, *, max_atoms: int = 16) -> Atoms:
    """Validate the model's structure JSON (a dict or a JSON string) into ASE ``Atoms`` (periodic)."""
    if isinstance(data, str):
        try:
            data = loads(data)
        except UntrustedJSONError as exc:  # also nesting too deep, integers too long
            raise InvalidActionError(f"structure is not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise InvalidActionError('structure must be an object with "lattice", "species" and "frac_coords"')
    missing = [k for k in ("lattice", "species", "frac_coords") if k not in data]
    if missing:
        raise InvalidActionError(f"structure is missing {', '.join(repr(m) for m in missing)}")
    species = data["species"]
    if not isinstance(species, list) or not species or not all(isinstance(s, str) for s in species):
        raise InvalidActionError('"species" must be a non-empty list of element symbols')
    unknown = sorted({s for s in species if s not in _ELEMENTS})
    if unknown:
        raise InvalidActionError(f"unknown element(s) {', '.join(unknown)}")
    if len(species) > max_atoms:
        raise InvalidActionError(f"structure has {len(species)} atoms; at most {max_atoms} are allowed")
    frac = _numbers(data["frac_coords"], '"frac_coords"')
    if frac.shape != (len(species), 3):
        raise InvalidActionError(
            f'"frac_coords" must be {len(species)} rows of 3 numbers (one per species), got shape {list(frac.shape)}'
        )
    lattice_raw = data["lattice"]
    lattice = _numbers(lattice_raw, '"lattice"')
    if lattice.shape == (6,):
        a, b, c, alpha, beta, gamma = lattice
        if min(a, b, c) <= 0 or not all(0 < x < 180 for x in (alpha, beta, gamma)):
            raise InvalidActionError(
                '"lattice" parameters need positive lengths and angles strictly between 0 and 180'
            )
        cell = cellpar_to_cell(lattice)
    elif lattice.shape == (3, 3):
        cell = lattice
    else:
        raise InvalidActionError('"lattice" must be a 3x3 matrix or [a, b, c, alpha, beta, gamma]')
    volume = abs(float(np.linalg.det(cell)))
    per_atom = volume / len(species)
    if not (MIN_VOLUME_PER_ATOM <= per_atom <= MAX_VOLUME_PER_ATOM):
        raise InvalidActionError(
            f"cell volume is {per_atom:.3g} Å^3 per atom; a crystal has "
            f"{MIN_VOLUME_PER_ATOM:g}-{MAX_VOLUME_PER_ATOM:g} Å^3 per atom"
        )
    atoms = Atoms(symbols=species, scaled_positions=frac % 1.0, cell=cell, pbc=True)
    shortest = min_distance(atoms)
    if shortest < MIN_DISTANCE:
        raise InvalidActionError(
            f"atoms overlap: two atoms are {shortest:.3f} Å apart (minimum {MIN_DISTANCE} Å)"
        )
    return atoms


def min_distance(atoms: Atoms) -> float:
    """Shortest distance between two atoms, or an atom and its own periodic image (Å)."""
    pos = atoms.get_positions()
    _, dist = get_distances(pos, pos, cell=atoms.cell, pbc=atoms.pbc)
    n = len(atoms)
    if n > 1:
        dist = dist + np.diag(np.full(n, np.inf))
        shortest = float(dist.min())
    else:
        shortest = math.inf
    # self-images: the shortest lattice vector among small integer combinations
    cell = np.asarray(atoms.cell)
    grid = np.array(
        [(i, j, k) for i in (-1, 0, 1) for j in (-1, 0, 1) for k in (-1, 0, 1) if (i, j, k) != (0, 0, 0)]
    )
    shortest_image = float(np.linalg.norm(grid @ cell, axis=1).min())
    return min(shortest, shortest_image)


def structure_to_dict(atoms: Atoms, digits: int = 6) -> dict[str, Any]:
    """The model-facing JSON of ``atoms`` (3x3 lattice rows, wrapped fractional coordinates)."""
    return {
        "lattice": [[round(float(x), digits) for x in row] for row in np.asarray(atoms.cell)],
        "species": list(atoms.get_chemical_symbols()),
        "frac_coords": [
            [round(float(x) % 1.0, digits) for x in row] for row in atoms.get_scaled_positions(wrap=True)
        ],
    }


def structure_hash(atoms: Atoms, *extra: str) -> str:
    """Canonical sha256 of ``atoms`` (see the module docstring); ``extra`` adds e.g. calculator and task."""
    cell = np.round(np.asarray(atoms.cell, dtype=float), 5) + 0.0  # + 0.0 turns -0.0 into 0.0
    frac = np.round(atoms.get_scaled_positions(wrap=True), 5) % 1.0
    sites = sorted(
        (s, *(float(f"{x:.5f}") for x in row))
        for s, row in zip(atoms.get_chemical_symbols(), frac, strict=True)
    )
    payload = json.dumps({"cell": cell.tolist(), "sites": sites, "extra": list(extra)}, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()
