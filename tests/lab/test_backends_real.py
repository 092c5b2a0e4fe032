"""The CHGNet and PySCF backends, exercised for real (marked slow; skipped when not installed)."""

from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk

from labrl.errors import EnvTimeoutError
from labrl.lab_adapters.simulator import SimulatorAdapter
from labrl.lab_adapters.structures import structure_to_dict

needs_chgnet = pytest.mark.skipif(
    importlib.util.find_spec("chgnet") is None,
    reason="CHGNet is not installed: pip install 'labrl[chgnet]' to run the real CHGNet backend test",
)
needs_pyscf = pytest.mark.skipif(
    importlib.util.find_spec("pyscf") is None,
    reason="PySCF is not installed: pip install 'labrl[dft]' to run the real DFT backend test",
)


def _h2_in_a_box(bond: float = 0.74, box: float = 4.0) -> dict:
    atoms = Atoms("H2", positions=[(0, 0, 0), (0, 0, bond)], cell=np.eye(3) * box, pbc=True)
    atoms.translate((box / 2, box / 2, box / 2 - bond / 2))
    return structure_to_dict(atoms, digits=6)


@pytest.mark.slow
@needs_chgnet
async def test_chgnet_energy_of_silicon():
    adapter = SimulatorAdapter(timeout_s=300)
    structure = structure_to_dict(bulk("Si", "diamond", a=5.43))
    try:
        result = await adapter.calculate(
            {"kind": "calculation", "backend": "chgnet", "task": "energy", "structure": structure}
        )
        strained = await adapter.calculate(
            {
                "kind": "calculation",
                "backend": "chgnet",
                "task": "energy",
                "structure": structure_to_dict(bulk("Si", "diamond", a=5.0)),
            }
        )
    finally:
        await adapter.aclose()
    # CHGNet is fitted to Materials Project (PBE) energies: diamond Si is about -5.4 eV/atom
    assert result["natoms"] == 2
    assert -5.7 < result["energy_per_atom_ev"] < -5.1
    # compressing the cell by 8 % costs energy
    assert strained["energy_per_atom_ev"] > result["energy_per_atom_ev"] + 0.05


@pytest.mark.slow
@needs_pyscf
async def test_pyscf_dft_energy_of_h2_in_a_killable_subprocess():
    adapter = SimulatorAdapter(timeout_s=120)
    request = {"kind": "calculation", "backend": "pyscf", "task": "energy", "structure": _h2_in_a_box()}
    try:
        result = await adapter.calculate(request)
        stretched = await adapter.calculate({**request, "structure": _h2_in_a_box(bond=1.2)})
    finally:
        await adapter.aclose()
    # LDA total energy of H2 is about -1.13 Hartree = -30.7 eV (GTH pseudopotential, Gamma point)
    assert -32.5 < result["energy_ev"] < -29.0, result
    assert stretched["energy_ev"] > result["energy_ev"] + 0.2  # 1.2 Å is far from the 0.74 Å bond


@pytest.mark.slow
@needs_pyscf
async def test_pyscf_is_killed_at_its_deadline():
    adapter = SimulatorAdapter(timeout_s=0.5)
    request = {
        "kind": "calculation",
        "backend": "pyscf",
        "task": "energy",
        "structure": _h2_in_a_box(box=7.0),
    }
    try:
        with pytest.raises(EnvTimeoutError, match=re.escape("did not finish within 0.5 s; killed")):
            await adapter.calculate(request)
    finally:
        await adapter.aclose()
