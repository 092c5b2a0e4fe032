"""The v1 phase library: common phases with citations, polymorph ids, mixed valence, user CIFs."""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
from pymatgen.analysis.diffraction.xrd import XRDCalculator
from pymatgen.core import Lattice, Structure
from pymatgen.io.cif import CifWriter

from labrl.errors import ConfigError, StructureFileError
from labrl.verifiers.xrd.build_library import _phase_record
from labrl.verifiers.xrd.library import _phase_from_record, load_library, resolve_phase
from labrl.verifiers.xrd.phase_records import phase_record_v1
from labrl.verifiers.xrd.simulate import stick_pattern

TOL = 1e-6
COMMON = [
    "ZnO_186_hP4", "Fe2O3_167_hR10", "Fe3O4_227_cF56", "NiO_225_cF8", "CeO2_225_cF12", "BaTiO3_99_tP5",
    "LaB6_221_cP7", "Si_227_cF8", "Al2O3_167_hR10", "TiO2_141_tI12", "TiO2_136_tP6", "MgO_225_cF8",
    "NaCl_225_cF8", "CaCO3_167_hR10", "SiO2_152_hP9", "CuO_15_mC8", "Cu2O_224_cP6", "Cu_225_cF4",
    "Au_225_cF4", "Ag_225_cF4", "Al_225_cF4", "Fe_229_cI2", "Ni_225_cF4", "ZrO2_14_mP12",
    "SrTiO3_221_cP5", "Y2O3_206_cI80",
]  # fmt: skip


def _magnetite(with_valences: bool) -> Structure:
    """Fleet (1981) magnetite; 16d holds Fe2+ and Fe3+ half each when ``with_valences``."""
    octa = {"Fe2+": 0.5, "Fe3+": 0.5} if with_valences else {"Fe": 1.0}
    tetra = {"Fe3+": 1.0} if with_valences else {"Fe": 1.0}
    oxygen = {"O2-": 1.0} if with_valences else {"O": 1.0}
    x = 0.2549 + 0.125
    return Structure.from_spacegroup(
        "Fd-3m", Lattice.cubic(8.3941), [tetra, octa, oxygen], [[0.25] * 3, [0.625] * 3, [x] * 3]
    )


def test_common_phases_are_experimental_with_citations():
    library = load_library("v1")
    for pid in COMMON:
        phase = library.get(pid)
        assert phase.experimental, pid
        assert len(phase.citation) > 15, pid
    assert len(library.experimental()) >= 350
    assert len(library) == 594
    assert {p.source for p in library} == {"curated", "ase-cif", "aflow", "ase", "substitution"}
    assert all(not p.experimental for p in library if p.source == "substitution")


def test_ids_tell_polymorphs_apart():
    library = load_library("v1")
    scheme = re.compile(r"^[A-Z][A-Za-z0-9()]*_\d{1,3}_[amothc][PCIFR]\d+(-[b-z])?$")
    assert all(scheme.match(p.id) for p in library), [p.id for p in library if not scheme.match(p.id)]
    diamond, clathrate = library.get("Si_227_cF8"), library.get("Si_227_cF136")
    assert len(diamond.frac_coords) == 8 and len(clathrate.frac_coords) == 34  # primitive cell of cF136
    # diamond Si (111) with Cu Kα1: d = a/√3, 2θ = 2 asin(λ/2d)
    sticks = stick_pattern(diamond, wavelength=1.54056, two_theta_range=(20, 40))
    expected = 2 * math.degrees(math.asin(1.54056 / (2 * 5.431195 / math.sqrt(3))))
    assert sticks.two_theta[0] == pytest.approx(expected, abs=1e-9)
    assert len(sticks.two_theta) == 1  # (200) is forbidden in diamond
    # answers naming formula + space group resolve to the cited (first-listed) polymorph
    assert library.by_key(diamond.key) is diamond


def test_v0_library_unchanged_and_ids_disjoint():
    v0, v1 = load_library(), load_library("v1")
    assert len(v0) == 591 and "Si_227" in v0 and "NaCl_225" in v0
    assert not {p.id for p in v0} & {p.id for p in v1}
    assert resolve_phase("Si_227").id == "Si_227" and resolve_phase("Si_227_cF8").source == "curated"
    with pytest.raises(ConfigError):
        load_library("v9")  # type: ignore[arg-type]


def test_magnetite_mixed_valence_intensities_match_pymatgen():
    structure = _magnetite(with_valences=True)
    phase = _phase_from_record(
        phase_record_v1(structure, source="test", experimental=True, citation="Fleet 1981")
    )
    assert phase.id == "Fe3O4_227_cF56"
    ref = XRDCalculator("CuKa").get_pattern(structure)
    mine = stick_pattern(phase)
    np.testing.assert_allclose(mine.two_theta, ref.x, atol=TOL)
    np.testing.assert_allclose(mine.scaled, ref.y, atol=100 * TOL)
    # and equal to the shipped v1 magnetite (built from neutral Fe on both sites)
    shipped = stick_pattern(load_library("v1").get("Fe3O4_227_cF56"))
    np.testing.assert_allclose(shipped.scaled, mine.scaled, atol=1e-6)
    # the v0 builder kept one valence of the mixed site: half the octahedral iron is lost
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        old = _phase_from_record(
            {**_phase_record(structure, "test", {}), "cell_mass": 1.0, "volume": structure.volume}
        )
    assert old.occupancy.sum() == pytest.approx(56 - 8)
    lost = stick_pattern(old)
    common = np.intersect1d(np.round(lost.two_theta, 6), np.round(mine.two_theta, 6))
    assert len(common) > 10
    worst = max(
        abs(
            lost.scaled[np.round(lost.two_theta, 6) == t][0]
            - mine.scaled[np.round(mine.two_theta, 6) == t][0]
        )
        for t in common
    )
    assert worst > 20.0  # percent of the strongest peak


def test_user_cifs_join_and_duplicates_are_dropped(tmp_path):
    kbr = Structure.from_spacegroup("Fm-3m", Lattice.cubic(6.600), ["K", "Br"], [[0, 0, 0], [0.5, 0.5, 0.5]])
    nacl = Structure.from_spacegroup("Fm-3m", Lattice.cubic(5.62), ["Na", "Cl"], [[0, 0, 0], [0.5, 0.5, 0.5]])
    folder = tmp_path / "cifs"
    folder.mkdir()
    CifWriter(kbr).write_file(folder / "kbr.cif")
    CifWriter(nacl).write_file(folder / "halite_again.cif")
    base = load_library("v1")
    library = load_library("v1", extra_cifs=[folder])
    assert len(library) == len(base) + 1  # NaCl matches the curated halite
    added = library.get("KBr_225_cF8")
    assert added.source == "user" and added.experimental and "kbr.cif" in added.citation
    assert resolve_phase("KBr_225_cF8") is added
    assert added.abc == pytest.approx((6.6, 6.6, 6.6))
    # the same file twice joins once
    again = load_library("v1", extra_cifs=[folder / "kbr.cif", folder / "kbr.cif"])
    assert len(again) == len(base) + 1


def test_bad_cifs_raise_structure_file_errors(tmp_path):
    with pytest.raises(StructureFileError, match="no such"):
        load_library("v1", extra_cifs=[tmp_path / "missing.cif"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(StructureFileError, match=r"no \.cif"):
        load_library("v1", extra_cifs=[tmp_path / "empty"])
    junk = tmp_path / "junk.cif"
    junk.write_text("data_x\n_cell_length_a 3\nthis is not a cif loop\n")
    with pytest.raises(StructureFileError):
        load_library("v1", extra_cifs=[junk])


def test_curated_phases_match_pymatgen():
    calc = XRDCalculator("CuKa")
    for phase in load_library("v1"):
        if phase.source not in ("curated", "ase-cif"):
            continue
        ref = calc.get_pattern(phase.to_pymatgen())
        mine = stick_pattern(phase)
        assert len(mine.two_theta) == len(ref.x), phase.id
        assert np.abs(mine.two_theta - ref.x).max() < TOL, phase.id
        assert np.abs(mine.scaled - ref.y).max() / 100 < TOL, phase.id
