"""Build the shipped XRD phase library (``data/phases.json``) from installed packages.

Run once, offline, after upgrading pymatgen or ASE::

    python -m labrl.verifiers.xrd.build_library            # rewrites data/phases.json (v0)
    python -m labrl.verifiers.xrd.build_library --check    # exit 1 if the file is stale
    python -m labrl.verifiers.xrd.build_library --version v1   # data/phases_v1.json

The v1 library (see ``build_library_v1`` and docs/xrd-library.md) puts the
curated common phases of ``data/common_phases.json`` and the COD CIFs shipped
in ASE first, keeps mixed-valence and partially occupied sites (occupancies of
one element summed over its oxidation states), marks every entry experimental
or hypothetical with its citation, and ids phases ``formula_sg_pearson``.
v0 (below) is frozen: its file is what ``xrd/phase-id-v0`` tasks were built on.

Sources, all shipped inside installed wheels (no downloads):

1. ``aflow``: pymatgen's AFLOW prototype library
   (``pymatgen/analysis/prototypes/aflow_prototypes.json.gz``, 288 structures,
   the AFLOW Library of Crystallographic Prototypes, MIT via pymatgen).
2. ``ase``: ASE's elemental reference states (``ase.data.reference_states``,
   fcc / bcc / hcp / diamond with their tabulated lattice constants) built with
   ``ase.build.bulk``.
3. ``substitution``: small AFLOW prototypes (<= 8 sites, <= 3 elements) with
   one element swapped for its neighbour below in the same group, the lattice
   scaled by the ratio of summed atomic radii. These are hypothetical
   isostructural decoys: same peaks pattern, shifted and re-weighted, which is
   what makes phase identification hard.

Phases are keyed by (reduced formula, space-group number); the first source to
claim a key wins (aflow, then ase, then substitution). Space groups come from
spglib via ``SpacegroupAnalyzer(symprec=0.01)``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from labrl.verifiers.xrd.phase_records import (
    DATA,
    LIBRARY_V0_FORMAT,
    LIBRARY_V0_PATH,
    LIBRARY_V1_FORMAT,
    LIBRARY_V1_PATH,
    SYMPREC,
    merge_unique,
    phase_record_v1,
)

COMMON_PHASES_PATH = DATA / "common_phases.json"
_MAX_SUB_SITES = 8


def _phase_record(structure: Any, source: str, tags: dict[str, Any]) -> dict[str, Any] | None:
    from pymatgen.symmetry.analyzer import SpacegroupAnalyzer

    from labrl.verifiers.xrd.scattering import scattering_table

    table = scattering_table()
    elements = sorted({sp.symbol for site in structure for sp in site.species})
    if any(el not in table.params for el in elements):
        return None
    sga = SpacegroupAnalyzer(structure, symprec=SYMPREC)
    comp = structure.composition
    reduced, _factor = comp.get_reduced_composition_and_factor()
    return {
        "id": f"{comp.reduced_formula}_{sga.get_space_group_number()}",
        "formula": comp.reduced_formula,
        "composition": {el.symbol: float(amt) for el, amt in reduced.items()},
        "elements": elements,
        "spacegroup_symbol": sga.get_space_group_symbol(),
        "spacegroup_number": int(sga.get_space_group_number()),
        "crystal_system": sga.get_crystal_system(),
        "lattice": structure.lattice.matrix.tolist(),
        "abc": [round(x, 6) for x in structure.lattice.abc],
        "angles": [round(x, 6) for x in structure.lattice.angles],
        "sites": [
            {
                "species": {sp.symbol: float(occ) for sp, occ in site.species.items()},
                "frac": site.frac_coords.tolist(),
            }
            for site in structure
        ],
        "source": source,
        "tags": tags,
    }


def _aflow() -> list[dict[str, Any]]:
    import pymatgen.analysis.prototypes as protos
    from pymatgen.core import Structure

    path = Path(protos.__file__).with_name("aflow_prototypes.json.gz")
    with gzip.open(path, "rt") as fh:
        entries = json.load(fh)
    out = []
    for entry in entries:
        snl = entry["snl"]
        structure = Structure.from_dict({"lattice": snl["lattice"], "sites": snl["sites"]})
        tags = {k: v for k, v in entry["tags"].items() if v}
        record = _phase_record(structure, "aflow", tags)
        if record is not None:
            out.append(record)
    return out


def _ase_elements() -> list[dict[str, Any]]:
    from ase.build import bulk
    from ase.data import chemical_symbols, reference_states
    from pymatgen.io.ase import AseAtomsAdaptor

    out = []
    for z, state in enumerate(reference_states):
        if not state or state.get("symmetry") not in ("fcc", "bcc", "hcp", "diamond"):
            continue
        symbol = chemical_symbols[z]
        kwargs: dict[str, Any] = {"crystalstructure": state["symmetry"], "a": state["a"]}
        if state["symmetry"] == "hcp":
            kwargs["c"] = state["a"] * state["c/a"]
        atoms = bulk(symbol, **kwargs)
        structure = AseAtomsAdaptor.get_structure(atoms)
        record = _phase_record(structure, "ase", {"prototype": state["symmetry"]})
        if record is not None:
            out.append(record)
    return out


def _substitutions(parents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from pymatgen.core import Element, Lattice, Structure

    def below(symbol: str) -> str | None:
        el = Element(symbol)
        if (
            el.is_noble_gas
            or el.is_lanthanoid
            or el.atomic_radius is None
            or el.is_actinoid
            or el.group in (None,)
            or el.row >= 6
        ):
            return None
        for cand in Element:
            if cand.group == el.group and cand.row == el.row + 1 and not cand.is_lanthanoid:
                return (
                    cand.symbol if cand.atomic_radius is not None and el.atomic_radius is not None else None
                )
        return None

    out = []
    for parent in parents:
        if (
            parent["source"] != "aflow"
            or len(parent["sites"]) > _MAX_SUB_SITES
            or len(parent["elements"]) > 3
        ):
            continue
        for old in parent["elements"]:
            new = below(old)
            if new is None or new in parent["elements"]:
                continue
            r_old = sum(
                Element(el).atomic_radius * occ for s in parent["sites"] for el, occ in s["species"].items()
            )
            species = [
                {(new if el == old else el): occ for el, occ in s["species"].items()} for s in parent["sites"]
            ]
            r_new = sum(Element(el).atomic_radius * occ for s in species for el, occ in s.items())
            scale = float(r_new / r_old)
            lattice = Lattice([[x * scale for x in row] for row in parent["lattice"]])
            structure = Structure(lattice, species, [s["frac"] for s in parent["sites"]])
            tags = {"parent": parent["id"], "substitution": f"{old}->{new}", "lattice_scale": round(scale, 6)}
            record = _phase_record(structure, "substitution", tags)
            if record is not None:
                out.append(record)
    return out


def build_library() -> dict[str, Any]:
    phases: dict[str, dict[str, Any]] = {}
    aflow = _aflow()
    for record in [*aflow, *_ase_elements(), *_substitutions(aflow)]:
        phases.setdefault(record["id"], record)
    ordered = sorted(
        phases.values(), key=lambda r: ({"aflow": 0, "ase": 1, "substitution": 2}[r["source"]], r["id"])
    )
    from labrl.verifiers.xrd.scattering import scattering_table

    table = scattering_table()
    for record in ordered:
        # cell mass in amu and volume in Å^3: the Hill–Howard denominators
        record["cell_mass"] = sum(
            table.mass[el] * occ for s in record["sites"] for el, occ in s["species"].items()
        )
        m = record["lattice"]
        record["volume"] = abs(
            m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
        )
        assert math.isfinite(record["volume"]) and record["volume"] > 0
    import ase
    import pymatgen.core

    return {
        "version": LIBRARY_V0_FORMAT,
        "generated_with": {"pymatgen": pymatgen.core.__version__, "ase": ase.__version__},
        "license_note": "AFLOW prototypes: AFLOW Library of Crystallographic Prototypes as shipped (MIT) in pymatgen",
        "phases": ordered,
    }


# -- v1 ------------------------------------------------------------------------------------------

_MIN_DISTANCE = 0.9  # Å: closer atoms mean a wrong setting or coordinate in a curated entry


def curated_structure(entry: dict[str, Any]) -> Any:
    """The full cell of one ``common_phases.json`` entry, checked against its declared atom count."""
    from pymatgen.core import Lattice, Structure
    from pymatgen.symmetry.groups import SpaceGroup

    system = SpaceGroup(entry["spacegroup"]).crystal_system
    par = entry["lattice"]
    a = par["a"]
    hexagonal = system in ("hexagonal", "trigonal")
    lattice = Lattice.from_parameters(
        a,
        par.get("b", a),
        par.get("c", a),
        par.get("alpha", 90.0),
        par.get("beta", 90.0),
        par.get("gamma", 120.0 if hexagonal else 90.0),
    )
    shift = entry.get("origin_shift", [0.0, 0.0, 0.0])
    species = [site[0] for site in entry["sites"]]
    coords = [[x + d for x, d in zip(site[1], shift, strict=True)] for site in entry["sites"]]
    structure = Structure.from_spacegroup(entry["spacegroup"], lattice, species, coords, tol=1e-3)
    if len(structure) != entry["n_atoms"]:
        raise ValueError(f"{entry['name']}: {len(structure)} atoms in the cell, expected {entry['n_atoms']}")
    if (
        structure.composition.reduced_formula
        != structure.composition.from_dict(
            {k: v for k, v in _parse(entry["formula"]).items()}
        ).reduced_formula
    ):
        raise ValueError(
            f"{entry['name']}: built {structure.composition.reduced_formula}, not {entry['formula']}"
        )
    dist = structure.distance_matrix + np.eye(len(structure)) * 99.0
    if dist.min() < _MIN_DISTANCE:
        raise ValueError(f"{entry['name']}: two atoms {dist.min():.3f} Å apart")
    return structure


def _parse(formula: str) -> dict[str, float]:
    from labrl.verifiers.xrd.formula import parse_formula

    return {el: float(n) for el, n in parse_formula(formula).items()}


def _curated() -> list[dict[str, Any]]:
    entries = json.loads(COMMON_PHASES_PATH.read_text())["phases"]
    return [
        phase_record_v1(
            curated_structure(e),
            source="curated",
            experimental=e["experimental"],
            citation=e["citation"],
            name=e["name"],
        )
        for e in entries
    ]


def _cif_citation(block: dict[str, Any]) -> str:
    """'Authors, Journal Volume, Page (Year)' from a CIF block's _publ/_journal items."""
    authors = block.get("_publ_author_name") or []
    authors = [authors] if isinstance(authors, str) else list(authors)
    who = ", ".join(a.strip("'") for a in authors[:4]) + (" et al." if len(authors) > 4 else "")
    journal = str(block.get("_journal_name_full", "")).strip("'")
    vol, page, year = (block.get(k, "") for k in ("_journal_volume", "_journal_page_first", "_journal_year"))
    return f"{who}, {journal} {vol}, {page} ({year})".strip(", ")


def _ase_cifs() -> list[dict[str, Any]]:
    """The COD mineral CIFs shipped in ASE's wheel (``ase/test/testdata/minerals``)."""
    import ase
    from pymatgen.io.cif import CifParser

    folder = Path(ase.__file__).parent / "test" / "testdata" / "minerals"
    out = []
    for path in sorted(folder.glob("cod_*.cif")):
        parser = CifParser(path)
        block = next(iter(parser.as_dict().values()))
        structure = parser.parse_structures(primitive=False)[0]
        mineral = str(block.get("_chemical_name_mineral", "")).strip("'")
        cite = f"{_cif_citation(block)}; COD {path.stem[4:]}, CIF shipped in ase {ase.__version__}"
        out.append(
            phase_record_v1(
                structure, source="ase-cif", experimental=True, citation=cite, name=mineral.lower()
            )
        )
    return out


def _v0_as_v1(record: dict[str, Any]) -> dict[str, Any]:
    """A v0 record (aflow, ase, substitution) rebuilt with v1 ids, flags and citations."""
    from pymatgen.core import Lattice, Structure

    structure = Structure(
        Lattice(record["lattice"]),
        [s["species"] for s in record["sites"]],
        [s["frac"] for s in record["sites"]],
    )
    source, tags = record["source"], record["tags"]
    if source == "aflow":
        citation = (
            f"AFLOW Library of Crystallographic Prototypes, prototype {tags.get('aflow')} "
            "(M. J. Mehl et al., Comput. Mater. Sci. 136, S1 (2017)), as shipped in pymatgen"
        )
    elif source == "ase":
        citation = "ASE reference state (ase.data.reference_states: room-temperature lattice constant)"
    else:
        citation = (
            f"hypothetical: {tags['parent']} with {tags['substitution']}, lattice scaled by "
            f"{tags['lattice_scale']} (ratio of summed atomic radii)"
        )
    return phase_record_v1(
        structure, source=source, experimental=source != "substitution", citation=citation, tags=tags
    )


def build_library_v1() -> dict[str, Any]:
    """The v1 library: curated, then ASE's COD CIFs, then the v0 sources (deduplicated in that order)."""
    from labrl.verifiers.xrd.scattering import scattering_table

    v0 = build_library()["phases"]
    first = merge_unique([*_curated(), *_ase_cifs()])
    # a prototype with the id (formula, space group, Pearson symbol) of a cited entry is the same
    # compound in another (here: mis-set) description, e.g. AFLOW's anatase and tenorite, whose
    # patterns do not match the measured ones: the cited entry supersedes it
    cited = {r["id"] for r in first}
    # transuranium phases go: the anomalous-dispersion table (Chantler) stops at U (Z = 92)
    z = scattering_table().z
    rest = [
        r
        for r in (_v0_as_v1(r) for r in v0)
        if r["id"] not in cited and all(z[el] <= 92 for el in r["elements"])
    ]
    records = merge_unique(rest, existing=first)
    import ase
    import pymatgen.core

    return {
        "version": LIBRARY_V1_FORMAT,
        "generated_with": {"pymatgen": pymatgen.core.__version__, "ase": ase.__version__},
        "license_note": "curated entries: published experimental data (citation per entry); COD CIFs (CC0) "
        "shipped in ASE; AFLOW prototypes (MIT) shipped in pymatgen",
        "phases": records,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the shipped library differs from a rebuild"
    )
    parser.add_argument("--version", choices=("v0", "v1"), default="v0", help="which library file to build")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="No Pauling electronegativity")
    warnings.filterwarnings("ignore", message=".*fractional coordinates rounded.*")
    built, path = (
        (build_library(), LIBRARY_V0_PATH) if args.version == "v0" else (build_library_v1(), LIBRARY_V1_PATH)
    )
    text = json.dumps(built, indent=None, separators=(",", ":"), sort_keys=True)
    if args.check:
        same = path.exists() and path.read_text() == text
        print("up to date" if same else f"{path} is stale: rerun without --check")
        return 0 if same else 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    n = len(json.loads(text)["phases"])
    print(f"wrote {n} phases to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
