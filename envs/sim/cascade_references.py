"""The light crystals of ``materials/cascade-chgnet-pyscf-v0`` and their reference energies.

Each material is a two-atom primitive cell (``ase.build.bulk``) of a diamond, zincblende or
rocksalt crystal of light elements, within what PySCF covers (``lab_adapters/calculators.py``:
light elements, at most 4 atoms, single points). For each calculator ``c`` (``chgnet``, ``pyscf``)
the reference is the calculator's own equilibrium::

    a*_c   = argmin_a E_c(a)           bounded Brent, xatol 2e-3 Å, a in [0.85, 1.15] x a_exp
    E_ref_c = E_c(round(a*_c, 4)) / n  eV per atom, at the constant as the env answers it (1e-4 Å)

computed once by this module (``python -m labrl.envs.sim.cascade_references``, about ten minutes
on 2 cores) and shipped as ``data/cascade_references.json`` with the calculator settings they
hold for (CHGNet's version, PySCF's cutoff and basis): the env refuses a file made under other
settings, and never computes a reference at run time. The file also records the CPU-seconds of
every energy call, the measured cost behind the env's default stage costs.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from ase import Atoms
from ase.build import bulk

from labrl.errors import ConfigError
from labrl.lab_adapters.calculators import PYSCF_KE_CUTOFF_HA
from labrl.lab_adapters.structures import structure_to_dict

REFERENCES_PATH = Path(__file__).parent / "data" / "cascade_references.json"
#: the answer's precision (Å): candidates and references are rounded to it, so the gold answer
#: is the reference structure exactly
ANSWER_DIGITS = 4
BACKENDS = ("chgnet", "pyscf")
SEARCH_WINDOW = (0.85, 1.15)
XATOL_A = 2e-3


@dataclass(frozen=True)
class Material:
    formula: str
    structure: Literal["diamond", "zincblende", "rocksalt"]
    a_exp: float  # experimental cubic constant (Å), the centre of the search window
    split: Literal["train", "test"]

    def nearest_neighbour(self, a: float) -> float:
        """Nearest-neighbour distance (Å): ``a sqrt(3) / 4`` (diamond, zincblende), ``a / 2`` (rocksalt)."""
        return a / 2 if self.structure == "rocksalt" else a * 3**0.5 / 4


#: the catalogue; the split is fixed here so that any subset keeps train and test disjoint
MATERIALS: dict[str, Material] = {
    "C": Material("C", "diamond", 3.567, "train"),
    "Si": Material("Si", "diamond", 5.431, "train"),
    "BN": Material("BN", "zincblende", 3.615, "test"),
    "MgO": Material("MgO", "rocksalt", 4.212, "test"),
}


def crystal_structure(material: str, a: float) -> dict[str, Any]:
    """The two-atom primitive cell of ``material`` at cubic constant ``a`` (Å, rounded to the
    answer's precision), as the calculators' structure JSON."""
    m = MATERIALS[material]
    atoms: Atoms = bulk(m.formula, m.structure, a=round(a, ANSWER_DIGITS))
    return structure_to_dict(atoms, digits=10)


def energy_request(backend: str, material: str, a: float) -> dict[str, Any]:
    """The calculation request (``lab_adapters.calculators``) for the energy of ``material`` at ``a``:
    the one ``labrl.envs.sim.common.Calculator.run("energy", ...)`` sends."""
    return {
        "kind": "calculation",
        "backend": backend,
        "task": "energy",
        "structure": crystal_structure(material, a),
    }


def calculator_settings() -> dict[str, Any]:
    """What the references hold for: a file made under other settings is refused."""
    return {
        "chgnet_version": metadata.version("chgnet"),
        "pyscf_ke_cutoff_ha": PYSCF_KE_CUTOFF_HA,
        "pyscf_basis": "gth-szv",
        "pyscf_pseudo": "gth-pade",
        "pyscf_xc": "lda,vwn",
    }


@functools.cache
def load_references(path: Path = REFERENCES_PATH) -> dict[str, dict[str, dict[str, Any]]]:
    """``material -> backend -> {a, e_ref_per_atom_ev, calls, cpu_s_per_call}`` from ``path``;
    ``ConfigError`` if it is missing a material or was made under other calculator settings."""
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the cascade references {path}: {exc}") from exc
    made_under, now = document.get("settings"), calculator_settings()
    if made_under != now:
        raise ConfigError(
            f"{path} was made under calculator settings {made_under}, these are {now}: "
            "regenerate it with python -m labrl.envs.sim.cascade_references"
        )
    references: dict[str, dict[str, dict[str, Any]]] = document["materials"]
    missing = sorted(m for m in MATERIALS if set(references.get(m, {})) != set(BACKENDS))
    if missing:
        raise ConfigError(f"{path} has no reference of {BACKENDS} for {missing}")
    return references


def _reference(backend: str, material: str) -> dict[str, Any]:
    from scipy.optimize import minimize_scalar

    from labrl.lab_adapters.calculators import execute_calculation

    m = MATERIALS[material]
    seconds: list[float] = []

    def energy_per_atom(a: float) -> float:
        started = time.process_time()
        result = execute_calculation(energy_request(backend, material, a))
        seconds.append(time.process_time() - started)
        return float(result["energy_per_atom_ev"])

    lo, hi = (f * m.a_exp for f in SEARCH_WINDOW)
    found = minimize_scalar(energy_per_atom, bounds=(lo, hi), method="bounded", options={"xatol": XATOL_A})
    a_star = round(float(found.x), ANSWER_DIGITS)
    if min(a_star - lo, hi - a_star) < 0.01 * (hi - lo):
        raise RuntimeError(f"{backend} {material}: E(a) has no minimum inside [{lo:.3f}, {hi:.3f}] Å")
    return {
        "a": a_star,
        "e_ref_per_atom_ev": energy_per_atom(a_star),
        "calls": len(seconds),
        "cpu_s_per_call": [round(s, 3) for s in seconds],
    }


def _one(job: tuple[str, str]) -> tuple[str, str, dict[str, Any]]:
    backend, material = job
    return backend, material, _reference(backend, material)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REFERENCES_PATH)
    args = parser.parse_args(argv)
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(b, m) for m in MATERIALS for b in BACKENDS]
    references: dict[str, dict[str, Any]] = {m: {} for m in MATERIALS}
    with ProcessPoolExecutor(args.workers) as pool:
        for backend, material, found in pool.map(_one, jobs):
            references[material][backend] = found
            print(
                f"{material:4s} {backend:7s} a* = {found['a']:.4f} Å  E_ref = "
                f"{found['e_ref_per_atom_ev']:.4f} eV/atom  ({found['calls']} calls, median "
                f"{statistics.median(found['cpu_s_per_call']):.2f} cpu_s)",
                flush=True,
            )
    document = {"settings": calculator_settings(), "materials": references}
    args.out.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
