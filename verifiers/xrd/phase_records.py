"""Phase-library records: the shipped files, their format versions, and how a structure becomes a v1 record.

The runtime half of the library format, used by ``library`` (reading the
shipped files, adding the user's CIFs) and by the offline builder
``build_library`` (which imports from here, never the other way).

A record is a JSON object: id, formula, composition, elements, space group,
lattice rows (Å), sites (``{"species": {el: occupancy}, "frac": [x, y, z]}``),
source, citation, cell mass (amu) and volume (Å^3). v1 ids are
``formula_sg_pearson`` (``Si_227_cF8``); a second distinct phase with the same
id gets ``-b``, ``-c``, ... appended.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from labrl.errors import ConfigError

DATA = Path(__file__).with_name("data")
#: v0: ids ``formula_sg``, what ``xrd/phase-id-v0`` tasks are drawn from; frozen
LIBRARY_V0_PATH = DATA / "phases.json"
LIBRARY_V1_PATH = DATA / "phases_v1.json"
#: the ``version`` field each file must carry (a file format number, not the library's name:
#: the v0 file is format 1, the v1 file format 2)
LIBRARY_V0_FORMAT = 1
LIBRARY_V1_FORMAT = 2
#: spglib tolerance (Å) of every space-group assignment in the library
SYMPREC = 0.01

_FAMILY_LETTER = {
    "triclinic": "a",
    "monoclinic": "m",
    "orthorhombic": "o",
    "tetragonal": "t",
    "trigonal": "h",
    "hexagonal": "h",
    "cubic": "c",
}


def pearson_symbol(structure: Any, sga: Any | None = None) -> str:
    """Pearson symbol, e.g. ``cF8`` (diamond Si), ``hR10`` (corundum), ``cF136`` (Si clathrate).

    Crystal family letter, centring letter (A/B/C written C; rhombohedral R),
    then the number of sites of the conventional cell (of the rhombohedral
    primitive cell for R lattices), a disordered site counting once.
    """
    from pymatgen.symmetry.analyzer import SpacegroupAnalyzer

    sga = sga or SpacegroupAnalyzer(structure, symprec=SYMPREC)
    symbol = sga.get_space_group_symbol()
    centring = symbol[0] if symbol[0] in "PIFR" else "C"
    n = len(sga.get_conventional_standard_structure())
    if centring == "R":
        n //= 3
    return f"{_FAMILY_LETTER[sga.get_crystal_system()]}{centring}{n}"


def phase_record_v1(
    structure: Any,
    *,
    source: str,
    experimental: bool,
    citation: str,
    name: str = "",
    tags: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A v1 library record. Species of one element on a site (Fe2+ and Fe3+) are summed, not dropped.

    Raises ``ConfigError`` for elements without scattering coefficients.
    """
    from pymatgen.symmetry.analyzer import SpacegroupAnalyzer

    from labrl.verifiers.xrd.scattering import scattering_table

    table = scattering_table()
    sites = []
    for site in structure:
        species: dict[str, float] = {}
        for sp, occ in site.species.items():
            species[sp.symbol] = species.get(sp.symbol, 0.0) + float(occ)
        sites.append({"species": species, "frac": site.frac_coords.tolist()})
    elements = sorted({el for s in sites for el in s["species"]})
    missing = [el for el in elements if el not in table.params]
    if missing:
        raise ConfigError(f"no X-ray scattering coefficients for {missing}")
    sga = SpacegroupAnalyzer(structure, symprec=SYMPREC)
    comp = structure.composition.element_composition
    reduced, _factor = comp.get_reduced_composition_and_factor()
    formula = comp.reduced_formula
    number = int(sga.get_space_group_number())
    m = structure.lattice.matrix
    return {
        "id": f"{formula}_{number}_{pearson_symbol(structure, sga)}",
        "name": name,
        "formula": formula,
        "composition": {el.symbol: float(amt) for el, amt in reduced.items()},
        "elements": elements,
        "spacegroup_symbol": sga.get_space_group_symbol(),
        "spacegroup_number": number,
        "crystal_system": sga.get_crystal_system(),
        "lattice": m.tolist(),
        "abc": [round(x, 6) for x in structure.lattice.abc],
        "angles": [round(x, 6) for x in structure.lattice.angles],
        "sites": sites,
        "source": source,
        "experimental": bool(experimental),
        "citation": citation,
        "tags": tags or {},
        "cell_mass": sum(table.mass[el] * occ for s in sites for el, occ in s["species"].items()),
        "volume": float(structure.lattice.volume),
    }


def merge_unique(
    records: list[dict[str, Any]],
    existing: list[dict[str, Any]] | None = None,
    matched: list[str] | None = None,
) -> list[dict[str, Any]]:
    """``existing`` + the records not matching any earlier one (pymatgen ``StructureMatcher``).

    Only records of equal reduced composition are compared. Distinct phases
    with equal ids (same formula, space group and Pearson symbol) get ``-b``,
    ``-c``, ... appended. ``matched``, when given, receives for every record the
    id it ends up as: its own (suffixed) id when kept, else the id of the entry it matched.
    """
    from pymatgen.analysis.structure_matcher import StructureMatcher
    from pymatgen.core import Lattice, Structure

    matcher = StructureMatcher()
    kept = list(existing or [])
    by_formula: dict[str, list[list[Any]]] = {}  # formula -> [record, its Structure or None (lazy)]

    def structure_of(r: dict[str, Any]) -> Any:
        return Structure(
            Lattice(r["lattice"]), [s["species"] for s in r["sites"]], [s["frac"] for s in r["sites"]]
        )

    def matches(structure: Any, entry: list[Any]) -> bool:
        if entry[1] is None:
            entry[1] = structure_of(entry[0])
        return bool(matcher.fit(structure, entry[1]))

    for r in kept:
        by_formula.setdefault(r["formula"], []).append([r, None])
    ids = {r["id"] for r in kept}
    for r in records:
        same = by_formula.get(r["formula"], [])
        structure = structure_of(r) if same else None
        hit = next((entry for entry in same if matches(structure, entry)), None) if same else None
        if hit is not None:
            if matched is not None:
                matched.append(hit[0]["id"])
            continue
        base, suffix = r["id"], iter("bcdefghijklmnopqrstuvwxyz")
        while r["id"] in ids:
            r = {**r, "id": f"{base}-{next(suffix)}"}
        ids.add(r["id"])
        if matched is not None:
            matched.append(r["id"])
        kept.append(r)
        by_formula.setdefault(r["formula"], []).append([r, structure])
    return kept
