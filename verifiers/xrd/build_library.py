"""Build the shipped XRD phase library (``data/phases.json``) from installed packages.

Run once, offline, after upgrading pymatgen or ASE::

    python -m labrl.verifiers.xrd.build_library            # rewrites data/phases.json
    python -m labrl.verifiers.xrd.build_library --check    # exit 1 if the file is stale

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

LIBRARY_PATH = Path(__file__).with_name("data") / "phases.json"
LIBRARY_VERSION = 1
_SYMPREC = 0.01
_MAX_SUB_SITES = 8


def _phase_record(structure: Any, source: str, tags: dict[str, Any]) -> dict[str, Any] | None:
    from pymatgen.symmetry.analyzer import SpacegroupAnalyzer

    from labrl.verifiers.xrd.scattering import scattering_table

    table = scattering_table()
    elements = sorted({sp.symbol for site in structure for sp in site.species})
    if any(el not in table.params for el in elements):
        return None
    sga = SpacegroupAnalyzer(structure, symprec=_SYMPREC)
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
        "version": LIBRARY_VERSION,
        "generated_with": {"pymatgen": pymatgen.core.__version__, "ase": ase.__version__},
        "license_note": "AFLOW prototypes: AFLOW Library of Crystallographic Prototypes as shipped (MIT) in pymatgen",
        "phases": ordered,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the shipped library differs from a rebuild"
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="No Pauling electronegativity")
    text = json.dumps(build_library(), indent=None, separators=(",", ":"), sort_keys=True)
    if args.check:
        same = LIBRARY_PATH.exists() and LIBRARY_PATH.read_text() == text
        print("up to date" if same else f"{LIBRARY_PATH} is stale: rerun without --check")
        return 0 if same else 1
    LIBRARY_PATH.parent.mkdir(parents=True, exist_ok=True)
    LIBRARY_PATH.write_text(text)
    n = len(json.loads(text)["phases"])
    print(f"wrote {n} phases to {LIBRARY_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
