"""``identify`` and ``labrl xrd identify`` on simulated measurements written to pattern files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pattern_files import SAMPLE, simulated, write_csv, write_xrdml, write_xy

from labrl.cli import main
from labrl.errors import ConfigError, StructureFileError
from labrl.verifiers.xrd.identify import candidate_phases, identify, instrument_for, pattern_beams
from labrl.verifiers.xrd.library import load_library
from labrl.verifiers.xrd.readers import read_pattern
from labrl.verifiers.xrd.scattering import CU_KA1, CU_KA2

TRUTH = {c.phase_id: c.weight_fraction for c in SAMPLE.components}


@pytest.fixture(scope="module")
def xrdml(tmp_path_factory):
    x, y = simulated(seed=1)
    return write_xrdml(tmp_path_factory.mktemp("identify") / "mixture.xrdml", x, y)


def test_identify_recovers_phases_fractions_and_lattices(xrdml):
    result = identify(xrdml, top=3)  # the v1 library's experimental entries are screened
    best = result.best
    assert set(best.ids) == set(TRUTH)
    lib = load_library("v1")
    assert result.instrument.anomalous_dispersion and result.instrument.monochromator_two_theta is None
    assert best.fit.b_iso["NaCl_225_cF8"] == pytest.approx(1.0, abs=0.3)
    for p in best.phases:
        assert p.weight_fraction == pytest.approx(TRUTH[p.id], abs=0.03)
        assert np.allclose(p.abc, lib.get(p.id).abc, rtol=0.004)
    assert best.reward >= 0.9 and best.superfluous == ()
    assert all(r.reward < best.reward for r in result.ranked[1:])
    assert result.instrument.wavelength_ka1 == 1.5405980  # from the file, not the default
    assert {pid for pid, _ in result.screened[:4]} >= set(TRUTH)


def test_identify_with_user_cifs_and_no_library(tmp_path, xrdml):
    from pymatgen.io.cif import CifWriter

    lib = load_library("v1")
    cifs = []
    for pid in ["NaCl_225_cF8", "TiO2_136_tP6", "ZnS_216_cF8"]:  # ZnS is not in the sample
        path = tmp_path / f"{pid}.cif"
        CifWriter(lib.get(pid).to_pymatgen()).write_file(str(path))
        cifs.append(path)
    cifs.append(cifs[0])  # the same structure twice is one candidate
    result = identify(xrdml, cifs=cifs, library="none")
    assert set(result.best.ids) == set(TRUTH)
    assert {p.source for p in result.best.phases} == {"user"}
    assert len(result.screened) == 3
    fractions = {p.formula: p.weight_fraction for p in result.best.phases}
    assert fractions["NaCl"] == pytest.approx(0.6, abs=0.03)


def test_candidates_one_cif_reader_deduplicated_against_the_library(tmp_path):
    from pymatgen.core import Lattice, Structure
    from pymatgen.io.cif import CifWriter

    lib = load_library("v1")
    rutile = tmp_path / "rutile.cif"
    CifWriter(lib.get("TiO2_136_tP6").to_pymatgen()).write_file(str(rutile))
    cscl = tmp_path / "nacl_cscl.cif"  # NaCl in the CsCl structure (high pressure): not in the library
    CifWriter(Structure(Lattice.cubic(3.0), ["Na", "Cl"], [[0, 0, 0], [0.5, 0.5, 0.5]])).write_file(str(cscl))
    phases, n_cif = candidate_phases([rutile, cscl], "v1", ["Na", "Cl", "Ti", "O"])
    ids = [p.id for p in phases]
    assert n_cif == 2 and ids[0] == "TiO2_136_tP6" and phases[0].source == "curated"  # matched
    assert phases[1].source == "user" and phases[1].formula == "NaCl" and phases[1].spacegroup_number == 221
    assert len(ids) == len(set(ids))
    assert all(p.experimental for p in phases)
    everything, _ = candidate_phases([], "v1-all", ["Na", "Cl", "Ti", "O"])
    assert any(not p.experimental for p in everything)
    v0, _ = candidate_phases([], "v0", ["Na", "Cl"])
    assert "NaCl_225" in {p.id for p in v0}
    with pytest.raises(ConfigError, match="unknown library"):
        candidate_phases([], "v2")
    with pytest.raises(StructureFileError, match="no such CIF"):
        candidate_phases([tmp_path / "missing.cif"], "none")


def test_anode_wavelength_sets_the_doublet_and_unknown_is_monochromatic(tmp_path):
    x, y = simulated(seed=1)
    p = read_pattern(write_csv(tmp_path / "a.csv", x, y))
    cu_mean = (2 * CU_KA1 + CU_KA2) / 3
    (beam,) = pattern_beams(p, wavelength=cu_mean).beams
    inst = instrument_for(p, beam)
    assert (inst.wavelength_ka1, inst.wavelength_ka2, inst.ka2_ratio) == (CU_KA1, CU_KA2, 0.5)
    (synchrotron,) = pattern_beams(p, wavelength=0.8265).beams
    assert instrument_for(p, synchrotron).ka2_ratio == 0.0
    with pytest.raises(ConfigError, match="no wavelength"):
        pattern_beams(p)


def test_cli_identify_end_to_end_writes_png_and_json(tmp_path, capsys, xrdml):
    png = tmp_path / "fit.png"
    rc = main(["xrd", "identify", str(xrdml), "--elements", "Na,Cl,Ti,O,Zn,S", "--plot", str(png), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    best = out["ranked"][0]
    assert {p["id"] for p in best["phases"]} == set(TRUTH)
    assert best["reward"] >= 0.9 and out["plot"] == str(png)
    assert out["wavelength"]["ka2_ratio"] == 0.5
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_cli_text_output_and_typed_errors(tmp_path, capsys):
    x, y = simulated(seed=1)
    xy = write_xy(tmp_path / "m.xy", x, y)
    assert main(["xrd", "identify", str(xy), "--elements", "Na,Cl,Ti,O", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "#1  reward" in out and "NaCl_225_cF8" in out and "TiO2_136_tP6" in out and "#3" not in out

    csv = write_csv(tmp_path / "m.csv", x, y)
    assert main(["xrd", "identify", str(csv)]) == 2  # no wavelength anywhere
    assert "give --wavelength" in capsys.readouterr().err
    bad = tmp_path / "bad.xy"
    bad.write_text("10 1\n10.02 oops\n")
    assert main(["xrd", "identify", str(bad), "--wavelength", "1.5406"]) == 2
    assert f"{bad}:2: non-numeric" in capsys.readouterr().err
