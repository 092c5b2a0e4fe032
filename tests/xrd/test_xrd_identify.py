"""``identify`` and ``labrl xrd identify`` on simulated measurements written to pattern files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pattern_files import SAMPLE, simulated, write_csv, write_xrdml, write_xy

from labrl.cli import main
from labrl.errors import ConfigError
from labrl.verifiers.xrd.identify import identify, instrument_for
from labrl.verifiers.xrd.library import load_library
from labrl.verifiers.xrd.readers import read_pattern
from labrl.verifiers.xrd.scattering import CU_KA1, CU_KA2

TRUTH = {c.phase_id: c.weight_fraction for c in SAMPLE.components}


@pytest.fixture(scope="module")
def xrdml(tmp_path_factory):
    x, y = simulated(seed=1)
    return write_xrdml(tmp_path_factory.mktemp("identify") / "mixture.xrdml", x, y)


def test_identify_recovers_phases_fractions_and_lattices(xrdml):
    result = identify(xrdml, top=3)  # the whole library (591 phases) is screened
    best = result.best
    assert set(best.ids) == set(TRUTH)
    lib = load_library()
    for p in best.phases:
        assert p.weight_fraction == pytest.approx(TRUTH[p.id], abs=0.03)
        assert np.allclose(p.abc, lib.get(p.id).abc, rtol=0.004)
    assert best.reward >= 0.9 and best.superfluous == ()
    assert all(r.reward < best.reward for r in result.ranked[1:])
    assert result.instrument.wavelength_ka1 == 1.5405980  # from the file, not the default
    assert {pid for pid, _ in result.screened[:4]} >= set(TRUTH)


def test_identify_with_user_cifs_and_no_library(tmp_path, xrdml):
    from pymatgen.io.cif import CifWriter

    lib = load_library()
    cifs = []
    for pid in ["NaCl_225", "TiO2_136", "ZnS_216"]:  # ZnS is not in the sample
        path = tmp_path / f"{pid}.cif"
        CifWriter(lib.get(pid).to_pymatgen()).write_file(str(path))
        cifs.append(path)
    result = identify(xrdml, cifs=cifs, library="none")
    assert set(result.best.ids) == {"NaCl_225:NaCl_225", "TiO2_136:TiO2_136"}
    fractions = {p.formula: p.weight_fraction for p in result.best.phases}
    assert fractions["NaCl"] == pytest.approx(0.6, abs=0.03)


def test_anode_wavelength_sets_the_doublet_and_unknown_is_monochromatic(tmp_path):
    x, y = simulated(seed=1)
    p = read_pattern(write_csv(tmp_path / "a.csv", x, y))
    cu_mean = (2 * CU_KA1 + CU_KA2) / 3
    inst = instrument_for(p, cu_mean)
    assert (inst.wavelength_ka1, inst.wavelength_ka2, inst.ka2_ratio) == (CU_KA1, CU_KA2, 0.5)
    assert instrument_for(p, 0.8265).ka2_ratio == 0.0
    with pytest.raises(ConfigError, match="no wavelength"):
        instrument_for(p, None)


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
    assert "#1  reward" in out and "NaCl_225" in out and "TiO2_136" in out and "#3" not in out

    csv = write_csv(tmp_path / "m.csv", x, y)
    assert main(["xrd", "identify", str(csv)]) == 2  # no wavelength anywhere
    assert "give --wavelength" in capsys.readouterr().err
    bad = tmp_path / "bad.xy"
    bad.write_text("10 1\n10.02 oops\n")
    assert main(["xrd", "identify", str(bad), "--wavelength", "1.5406"]) == 2
    assert f"{bad}:2: non-numeric" in capsys.readouterr().err
