"""The small molecules of ``molecules/cascade-chgnet-pyscf-v0`` and their reference energies.

Each molecule is a diatomic of light elements in a periodic cubic box of ``BOX_A`` Å, within what
PySCF covers (``lab_adapters/calculators.py``: light elements, at most 4 atoms, single points at
the Gamma point, which is exact for an isolated molecule and a fair approximation in a small box;
a crystal's two-atom cell at the Gamma point alone puts its minimum far from any real constant).
For each calculator ``c`` (``chgnet``, ``pyscf``) the reference is the calculator's own
equilibrium::

    d*_c    = argmin_d E_c(d)           bounded Brent, xatol 2e-3 Å, d in [0.8, 1.5] x d_exp
    E_ref_c = E_c(round(d*_c, 4)) / n   eV per atom, at the bond length as the env answers it (1e-4 Å)

computed once by this module (``python -m labrl.envs.sim.cascade_references``, minutes on 2
cores) and shipped as ``data/cascade_references.json`` with the calculator settings they hold
for (CHGNet's version, PySCF's cutoff and basis, the box): the env refuses a file made under
other settings, and never computes a reference at run time. The file also records the
CPU-seconds of every energy call, the measured cost behind the env's default stage costs.
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

from labrl.errors import ConfigError
from labrl.lab_adapters.calculators import PYSCF_KE_CUTOFF_HA
from labrl.lab_adapters.structures import structure_to_dict

REFERENCES_PATH = Path(__file__).parent / "data" / "cascade_references.json"
#: the answer's precision (Å): candidates and references are rounded to it, so the gold answer
#: is the reference structure exactly
ANSWER_DIGITS = 4
BACKENDS = ("chgnet", "pyscf")
#: where the references are searched and where an answer is plausible (x the experimental bond
#: length): a single-zeta basis puts LDA's N2 and CO bonds near 1.25 x the experiment
SEARCH_WINDOW = (0.8, 1.5)
#: edge of the periodic box (Å): the images of a bond of 1.1 Å are 2.9 Å away
BOX_A = 4.0
XATOL = 2e-3


@dataclass(frozen=True)
class Molecule:
    atoms: tuple[str, str]
    d_exp: float  # experimental bond length (Å), the centre of the search window
    split: Literal["train", "test"]


#: the catalogue; the split is fixed here so that any subset keeps train and test disjoint
MOLECULES: dict[str, Molecule] = {
    "N2": Molecule(("N", "N"), 1.098, "train"),
    "CO": Molecule(("C", "O"), 1.128, "train"),
    "HF": Molecule(("H", "F"), 0.917, "test"),
}


def molecule_structure(molecule: str, d: float) -> dict[str, Any]:
    """``molecule`` with bond length ``d`` (Å, rounded to the answer's precision) along z, centred in
    its periodic box, as the calculators' structure JSON."""
    d = round(d, ANSWER_DIGITS)
    centre = BOX_A / 2
    atoms = Atoms(
        MOLECULES[molecule].atoms,
        positions=[(centre, centre, centre - d / 2), (centre, centre, centre + d / 2)],
        cell=[BOX_A, BOX_A, BOX_A],
        pbc=True,
    )
    return structure_to_dict(atoms, digits=10)


def energy_request(backend: str, molecule: str, d: float) -> dict[str, Any]:
    """The calculation request (``lab_adapters.calculators``) for the energy of ``molecule`` at ``d``:
    the one ``labrl.envs.sim.common.Calculator.run("energy", ...)`` sends."""
    return {
        "kind": "calculation",
        "backend": backend,
        "task": "energy",
        "structure": molecule_structure(molecule, d),
    }


def calculator_settings() -> dict[str, Any]:
    """What the references hold for: a file made under other settings is refused."""
    return {
        "chgnet_version": metadata.version("chgnet"),
        "pyscf_ke_cutoff_ha": PYSCF_KE_CUTOFF_HA,
        "pyscf_basis": "gth-szv",
        "pyscf_pseudo": "gth-pade",
        "pyscf_xc": "lda,vwn",
        "box_a": BOX_A,
    }


@functools.cache
def load_references(path: Path = REFERENCES_PATH) -> dict[str, dict[str, dict[str, Any]]]:
    """``molecule -> backend -> {d, e_ref_per_atom_ev, calls, cpu_s_per_call}`` from ``path``;
    ``ConfigError`` if it is missing a molecule or was made under other calculator settings."""
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
    references: dict[str, dict[str, dict[str, Any]]] = document["molecules"]
    missing = sorted(m for m in MOLECULES if set(references.get(m, {})) != set(BACKENDS))
    if missing:
        raise ConfigError(f"{path} has no reference of {BACKENDS} for {missing}")
    return references


def _reference(backend: str, molecule: str) -> dict[str, Any]:
    from scipy.optimize import minimize_scalar

    from labrl.lab_adapters.calculators import execute_calculation

    m = MOLECULES[molecule]
    seconds: list[float] = []

    def energy_per_atom(d: float) -> float:
        started = time.process_time()
        result = execute_calculation(energy_request(backend, molecule, d))
        seconds.append(time.process_time() - started)
        return float(result["energy_per_atom_ev"])

    lo, hi = (f * m.d_exp for f in SEARCH_WINDOW)
    found = minimize_scalar(energy_per_atom, bounds=(lo, hi), method="bounded", options={"xatol": XATOL})
    d_star = round(float(found.x), ANSWER_DIGITS)
    if min(d_star - lo, hi - d_star) < 0.01 * (hi - lo):
        raise RuntimeError(f"{backend} {molecule}: E(d) has no minimum inside [{lo:.3f}, {hi:.3f}] Å")
    return {
        "d": d_star,
        "e_ref_per_atom_ev": energy_per_atom(d_star),
        "calls": len(seconds),
        "cpu_s_per_call": [round(s, 3) for s in seconds],
    }


def _one(job: tuple[str, str]) -> tuple[str, str, dict[str, Any]]:
    backend, molecule = job
    return backend, molecule, _reference(backend, molecule)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REFERENCES_PATH)
    args = parser.parse_args(argv)
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # the DFT searches first: they take minutes, the CHGNet ones fill the gaps
    jobs = [(b, m) for b in reversed(BACKENDS) for m in MOLECULES]
    references: dict[str, dict[str, Any]] = {m: {} for m in MOLECULES}
    with ProcessPoolExecutor(args.workers) as pool:
        for future in as_completed([pool.submit(_one, job) for job in jobs]):
            try:
                backend, molecule, found = future.result()
            except Exception as exc:  # say so now; the other searches go on
                print(f"FAILED: {exc}", flush=True)
                continue
            references[molecule][backend] = found
            print(
                f"{molecule:4s} {backend:7s} d* = {found['d']:.4f} Å  E_ref = "
                f"{found['e_ref_per_atom_ev']:.4f} eV/atom  ({found['calls']} calls, median "
                f"{statistics.median(found['cpu_s_per_call']):.2f} cpu_s)",
                flush=True,
            )
    document = {"settings": calculator_settings(), "molecules": references}
    args.out.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
