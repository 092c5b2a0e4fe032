"""Calculator backends and the calculation requests they serve.

A calculation request (the same JSON for the local ``SimulatorAdapter`` and
for a remote lab's ``"calculation"`` jobs)::

    {"kind": "calculation", "backend": "emt", "task": "energy" | "relax" | "lattice",
     "structure": {...}, "a": 3.6}          # "a": starting cubic lattice constant for "lattice"

Tasks:

- ``energy``: total energy of the structure as given (eV) and per atom.
- ``relax``: BFGS on positions and cell (ASE ``FrechetCellFilter``) until the
  largest force is below ``fmax`` (eV/Å) or ``max_steps``; returns the relaxed
  structure and its energy. Needs forces and stress (EMT, CHGNet).
- ``lattice``: the equilibrium lattice constant of a cubic prototype: the
  structure's fractional coordinates are fixed by symmetry, so relaxing it is
  a 1-D minimisation of ``E(a)`` (bounded Brent, ``xatol`` 1e-5 Å) in
  ``[0.8 a0, 1.25 a0]``, re-bracketed when the minimum sits on an edge.
  Uses energies only, so every backend can do it.

Backends (``BACKENDS``): ``emt`` (ASE's effective-medium theory: Al, Cu, Ag,
Au, Ni, Pd, Pt, plus a rough H, C, N, O; milliseconds), ``chgnet`` (the
CHGNet universal potential, weights shipped in its wheel; optional extra
``labrl[chgnet]``), ``pyscf`` (Kohn-Sham DFT, LDA, GTH pseudopotentials and
the gth-szv basis at the Gamma point, cells of at most 4 atoms of light
elements; seconds to minutes, run in a killable subprocess; optional extra
``labrl[dft]``). ``check_backend`` refuses elements a backend cannot treat,
when the task is created rather than mid-run.

All functions here are module-level and picklable: they run in worker
processes (``labrl.offload``).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Any

import numpy as np
from ase import Atoms
from pydantic import BaseModel, ConfigDict

from labrl.errors import ConfigError, EnvError
from labrl.lab_adapters.structures import parse_structure, structure_to_dict

HARTREE_EV = 27.211386245988
#: kinetic-energy cutoff (Hartree) of PySCF's FFT density mesh. PySCF's own estimate from the
#: gth-szv exponents gives an 83^3 mesh for H2 in a 4 Å box (~30 s); 50 Ha gives 27^3, changes
#: that energy by < 0.05 eV and runs in about 2 s.
PYSCF_KE_CUTOFF_HA = 50.0


class Backend(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    elements: frozenset[str]
    tasks: frozenset[str]
    max_atoms: int
    killable: bool  # run in a subprocess that is killed at the deadline (hang-prone C code)
    module: str  # the import that must succeed

    def available(self) -> bool:
        return importlib.util.find_spec(self.module) is not None


_EMT_ELEMENTS = frozenset({"Al", "Cu", "Ag", "Au", "Ni", "Pd", "Pt", "H", "C", "N", "O"})
_CHGNET_ELEMENTS = frozenset(__import__("ase.data", fromlist=["chemical_symbols"]).chemical_symbols[1:95])
_PYSCF_ELEMENTS = frozenset(
    {"H", "Li", "Be", "B", "C", "N", "O", "F", "Na", "Mg", "Al", "Si", "P", "S", "Cl"}
)


def _potential(name: str, elements: frozenset[str], module: str) -> Backend:
    """An interatomic potential: it gives forces and stress, so it does every task; cells of up to
    64 atoms, run in process."""
    return Backend(
        name=name,
        elements=elements,
        tasks=frozenset({"energy", "relax", "lattice"}),
        max_atoms=64,
        killable=False,
        module=module,
    )


BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        _potential("emt", _EMT_ELEMENTS, "ase.calculators.emt"),
        _potential("chgnet", _CHGNET_ELEMENTS, "chgnet"),
        Backend(
            name="pyscf",
            elements=_PYSCF_ELEMENTS,
            tasks=frozenset({"energy", "lattice"}),
            max_atoms=4,
            killable=True,
            module="pyscf",
        ),
    )
}


def check_backend(
    name: str, elements: set[str] | frozenset[str], tasks: set[str] | frozenset[str]
) -> Backend:
    """The backend ``name`` if it exists, is installed, knows ``elements`` and can do ``tasks``; else ``ConfigError``."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown calculator backend {name!r}; choose from {', '.join(BACKENDS)}")
    backend = BACKENDS[name]
    unsupported = sorted(set(elements) - backend.elements)
    if unsupported:
        raise ConfigError(
            f"calculator backend {name!r} does not support element(s) {', '.join(unsupported)}; "
            f"it supports {', '.join(sorted(backend.elements))}"
        )
    missing_tasks = sorted(set(tasks) - backend.tasks)
    if missing_tasks:
        raise ConfigError(
            f"calculator backend {name!r} cannot do {', '.join(missing_tasks)} (it does {', '.join(sorted(backend.tasks))})"
        )
    if not backend.available():
        extra = {"chgnet": "chgnet", "pyscf": "dft"}.get(name, name)
        raise ConfigError(f"calculator backend {name!r} is not installed: pip install 'labrl[{extra}]'")
    return backend


@functools.cache
def _calculator(name: str) -> Any:
    if name == "emt":
        from ase.calculators.emt import EMT

        return EMT()
    if name == "chgnet":
        import torch
        from chgnet.model.dynamics import CHGNetCalculator

        torch.set_num_threads(1)
        return CHGNetCalculator(use_device="cpu")
    raise ConfigError(f"backend {name!r} has no ASE calculator")


def _pyscf_energy(atoms: Atoms) -> float:
    """Kohn-Sham LDA total energy (eV) at the Gamma point: gth-szv basis, gth-pade pseudopotentials."""
    from pyscf.pbc import dft, gto

    cell = gto.Cell()
    cell.atom = [
        (s, tuple(p)) for s, p in zip(atoms.get_chemical_symbols(), atoms.get_positions(), strict=True)
    ]
    cell.a = np.asarray(atoms.cell)
    cell.unit = "A"
    cell.basis = "gth-szv"
    cell.pseudo = "gth-pade"
    cell.ke_cutoff = PYSCF_KE_CUTOFF_HA
    cell.verbose = 0
    cell.build()
    cell.spin = cell.nelectron % 2
    cell.build()
    mf = dft.RKS(cell) if cell.spin == 0 else dft.UKS(cell)
    mf.xc = "lda,vwn"
    energy = mf.kernel()
    if not mf.converged:
        raise EnvError("PySCF SCF did not converge")
    return float(energy) * HARTREE_EV


def _energy(backend: str, atoms: Atoms) -> float:
    if backend == "pyscf":
        energy = _pyscf_energy(atoms)
    else:
        atoms = atoms.copy()
        atoms.calc = _calculator(backend)
        energy = float(atoms.get_potential_energy())
    if not math.isfinite(energy):
        raise EnvError(f"{backend} returned a non-finite energy ({energy})")
    return energy


def _relax(backend: str, atoms: Atoms, fmax: float, max_steps: int) -> tuple[Atoms, float, bool, int]:
    from ase.filters import FrechetCellFilter
    from ase.optimize import BFGS

    atoms = atoms.copy()
    atoms.calc = _calculator(backend)
    optimizer = BFGS(FrechetCellFilter(atoms), logfile=None)
    converged = bool(optimizer.run(fmax=fmax, steps=max_steps))
    energy = float(atoms.get_potential_energy())
    if not math.isfinite(energy):
        raise EnvError(f"{backend} relaxation reached a non-finite energy")
    return atoms, energy, converged, int(optimizer.nsteps)


def relax_lattice(backend: str, atoms: Atoms, a0: float) -> tuple[float, float]:
    """``(a*, E(a*))``: bounded Brent minimisation of the energy of ``atoms`` scaled to a cubic constant ``a``.

    ``atoms`` is given at lattice constant ``a0`` (its cell is ``a0`` times a
    fixed shape); fractional coordinates stay fixed.
    """
    from scipy.optimize import minimize_scalar

    shape = np.asarray(atoms.cell) / a0
    frac = atoms.get_scaled_positions()

    @functools.lru_cache(maxsize=256)
    def energy(a_rounded: float) -> float:
        scaled = Atoms(atoms.get_chemical_symbols(), scaled_positions=frac, cell=shape * a_rounded, pbc=True)
        return _energy(backend, scaled)

    lo, hi = 0.8 * a0, 1.25 * a0
    for _ in range(4):
        found = minimize_scalar(
            lambda a: energy(round(float(a), 7)), bounds=(lo, hi), method="bounded", options={"xatol": 1e-5}
        )
        a_star = float(found.x)
        width = hi - lo
        if a_star - lo < 0.01 * width:
            lo, hi = lo - 0.5 * width, lo + 0.2 * width
        elif hi - a_star < 0.01 * width:
            lo, hi = hi - 0.2 * width, hi + 0.5 * width
        else:
            return a_star, float(found.fun)
        if lo <= 0:
            break
    raise EnvError(f"{backend}: no energy minimum of E(a) found near a = {a0:.4g} Å")


def execute_calculation(request: dict[str, Any]) -> dict[str, Any]:
    """Run one calculation request (module docstring); returns plain JSON.

    BLAS runs single-threaded here: the linear algebra of a relaxation is a few 9x9 solves per
    step, where OpenBLAS threads only spin (20x slower on a loaded 2-core machine), and the
    parallelism comes from running many calculations in the process pool.
    """
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        return _execute(request)


def _execute(request: dict[str, Any]) -> dict[str, Any]:
    backend = request["backend"]
    task = request["task"]
    atoms = parse_structure(request["structure"], max_atoms=BACKENDS[backend].max_atoms)
    n = len(atoms)
    if task == "energy":
        energy = _energy(backend, atoms)
        return {"energy_ev": energy, "energy_per_atom_ev": energy / n, "natoms": n}
    if task == "relax":
        relaxed, energy, converged, steps = _relax(
            backend, atoms, float(request.get("fmax", 0.01)), int(request.get("max_steps", 300))
        )
        return {
            "energy_ev": energy,
            "energy_per_atom_ev": energy / n,
            "natoms": n,
            "converged": converged,
            "steps": steps,
            "structure": structure_to_dict(relaxed),
        }
    if task == "lattice":
        a_star, energy = relax_lattice(backend, atoms, float(request["a"]))
        return {"a": a_star, "energy_ev": energy, "energy_per_atom_ev": energy / n, "natoms": n}
    raise ConfigError(f"unknown calculation task {task!r}; choose from energy, relax, lattice")


def validate_calculation(request: dict[str, Any]) -> None:
    """Refuse a malformed calculation request (``ConfigError`` / ``InvalidActionError``) before running it."""
    backend = request.get("backend")
    task = request.get("task")
    if task not in ("energy", "relax", "lattice"):
        raise ConfigError(f"calculation task must be energy, relax or lattice, got {task!r}")
    atoms = parse_structure(
        request.get("structure"), max_atoms=BACKENDS.get(str(backend), BACKENDS["emt"]).max_atoms
    )
    check_backend(str(backend), set(atoms.get_chemical_symbols()), {task})
    if task == "lattice":
        a = request.get("a")
        if not isinstance(a, int | float) or not math.isfinite(a) or a <= 0:
            raise ConfigError(f'calculation task "lattice" needs a positive number "a", got {a!r}')
