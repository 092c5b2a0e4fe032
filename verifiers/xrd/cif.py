"""User CIF files -> ``Phase`` objects for ``identify`` (parsed by pymatgen's CifParser).

Partial and mixed occupancies are kept (the occupancy matrix is occupancy-weighted
scattering); oxidation states are dropped to the element. The cell mass Z·M is
Σ_sites Σ_elements occupancy · atomic mass and V = |det(lattice)|, the Hill–Howard
(ZMV) denominators. Ids are ``<file stem>:<formula>_<space group number>``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from labrl.errors import ConfigError
from labrl.verifiers.xrd.library import Phase
from labrl.verifiers.xrd.scattering import scattering_table

_SYMPREC = 0.01  # as the shipped library (build_library)


def phase_from_cif(path: str | Path) -> Phase:
    """The first structure in ``path`` as a ``Phase``; ConfigError naming the file when it cannot be used."""
    from pymatgen.core import Structure
    from pymatgen.symmetry.analyzer import SpacegroupAnalyzer

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such CIF file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pymatgen warns about rounding of occupancies and the like
            structure = Structure.from_file(str(path))
    except Exception as exc:  # pymatgen raises ValueError, KeyError, IndexError... for bad CIFs
        raise ConfigError(f"{path}: not a readable CIF ({type(exc).__name__}: {exc})") from None
    table = scattering_table()
    elements = sorted({sp.symbol for site in structure for sp in site.species})
    missing = [el for el in elements if el not in table.params]
    if missing:
        raise ConfigError(f"{path}: no scattering factors for {missing}")
    index = {el: i for i, el in enumerate(elements)}
    occupancy = np.zeros((len(structure), len(elements)))
    for n, site in enumerate(structure):
        for sp, occ in site.species.items():
            occupancy[n, index[sp.symbol]] += occ
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # spglib's OLD_ERROR_HANDLING notice
        sga = SpacegroupAnalyzer(structure, symprec=_SYMPREC)
        number = int(sga.get_space_group_number())
        symbol, system = sga.get_space_group_symbol(), sga.get_crystal_system()
    lattice = np.array(structure.lattice.matrix, dtype=float)
    frac = np.array(structure.frac_coords, dtype=float)
    cell_mass = float(sum(table.mass[el] * occupancy[:, i].sum() for el, i in index.items()))
    for arr in (lattice, frac, occupancy):
        arr.setflags(write=False)
    formula = structure.composition.reduced_formula
    return Phase(
        id=f"{path.stem}:{formula}_{number}",
        formula=formula,
        spacegroup_symbol=symbol,
        spacegroup_number=number,
        crystal_system=system,
        elements=tuple(elements),
        lattice=lattice,
        frac_coords=frac,
        occupancy=occupancy,
        cell_mass=cell_mass,
        volume=float(abs(np.linalg.det(lattice))),
        source=f"cif:{path}",
    )
