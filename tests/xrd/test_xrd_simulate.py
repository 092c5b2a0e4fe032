"""Stick patterns agree with pymatgen's XRDCalculator for every phase of the library."""

from __future__ import annotations

import numpy as np
import pytest
from pymatgen.analysis.diffraction.xrd import XRDCalculator
from pymatgen.core import Lattice, Structure

from labrl.verifiers.xrd.library import Phase, load_library
from labrl.verifiers.xrd.simulate import stick_pattern

TOL_POS = 1e-6  # degrees
TOL_INT = 1e-6  # relative to the strongest peak (scaled intensities / 100)


def _compare(phase: Phase, calc: XRDCalculator, **kwargs) -> tuple[float, float]:
    ref = calc.get_pattern(phase.to_pymatgen())
    mine = stick_pattern(phase, **kwargs)
    assert len(mine.two_theta) == len(ref.x), phase.id
    return float(np.abs(mine.two_theta - ref.x).max()), float(np.abs(mine.scaled - ref.y).max() / 100.0)


def test_library_shape():
    library = load_library()
    sources = {p.source for p in library}
    assert sources == {"aflow", "ase", "substitution"}
    assert sum(p.source == "aflow" for p in library) >= 280
    nacl = library.by_formula("ClNa")
    assert [p.id for p in nacl] == ["NaCl_225"]
    assert nacl[0].spacegroup_symbol == "Fm-3m"
    assert nacl[0].abc == pytest.approx((3.98757, 3.98757, 3.98757), abs=1e-4)


@pytest.mark.slow
def test_every_phase_matches_pymatgen():
    calc = XRDCalculator(wavelength="CuKa")
    worst_pos = worst_int = 0.0
    for phase in load_library():
        pos, inten = _compare(phase, calc)
        worst_pos, worst_int = max(worst_pos, pos), max(worst_int, inten)
    assert worst_pos < TOL_POS
    assert worst_int < TOL_INT


def test_debye_waller_matches_pymatgen():
    library = load_library()
    for pid in ("NaCl_225", "TiO2_136", "CaCO3_167"):
        phase = library.get(pid)
        b = {el: 0.3 + 0.2 * i for i, el in enumerate(phase.elements)}
        pos, inten = _compare(phase, XRDCalculator("CuKa", debye_waller_factors=b), debye_waller=b)
        assert pos < TOL_POS and inten < TOL_INT


def test_partial_occupancy_matches_pymatgen():
    # a disordered rock salt: (Na0.5 K0.5)Cl
    structure = Structure(
        Lattice.cubic(6.0), [{"Na": 0.5, "K": 0.5}, {"Cl": 1.0}] * 1, [[0, 0, 0], [0.5, 0.5, 0.5]]
    )
    phase = Phase(
        id="x",
        formula="NaKCl2",
        spacegroup_symbol="Pm-3m",
        spacegroup_number=221,
        crystal_system="cubic",
        elements=("Cl", "K", "Na"),
        lattice=structure.lattice.matrix,
        frac_coords=structure.frac_coords,
        occupancy=np.array([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]),
        cell_mass=1.0,
        volume=216.0,
        source="test",
    )
    ref = XRDCalculator("CuKa").get_pattern(structure)
    mine = stick_pattern(phase)
    np.testing.assert_allclose(mine.two_theta, ref.x, atol=TOL_POS)
    np.testing.assert_allclose(mine.scaled, ref.y, atol=100 * TOL_INT)


def test_bragg_law_by_hand():
    # simple cubic a = 4 Å: (100) at 2θ = 2 asin(λ / 2a)
    phase = load_library().get("NaCl_225")
    sticks = stick_pattern(phase)
    a = phase.abc[0] * np.sqrt(2)  # conventional cubic cell of the fcc primitive cell
    expected_111 = np.degrees(2 * np.arcsin(1.54184 * np.sqrt(3) / (2 * a)))
    assert sticks.two_theta[0] == pytest.approx(expected_111, abs=1e-9)
