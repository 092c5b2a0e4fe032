"""Pattern-file readers: values, units and wavelengths from the file; malformed files name file and line."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from pattern_files import simulated, write_csv, write_xrdml, write_xy

from labrl.errors import ConfigError, PatternFileError
from labrl.verifiers.xrd.readers import read_pattern


@pytest.fixture(scope="module")
def data():
    return simulated(seed=3)


def test_xy_reads_columns_and_wavelength_comment(tmp_path, data):
    x, y = data
    p = read_pattern(write_xy(tmp_path / "a.xy", x, y, wavelength=1.5406))
    np.testing.assert_allclose(p.two_theta, np.round(x, 4))
    np.testing.assert_allclose(p.intensity, np.round(y, 1))
    np.testing.assert_allclose(p.sigma, np.sqrt(np.maximum(np.round(y, 1), 1.0)))
    assert p.wavelength == 1.5406 and p.source["wavelength_from_file"] is True
    assert p.is_uniform and p.step == pytest.approx(0.02)


def test_xye_third_column_is_sigma(tmp_path, data):
    x, y = data
    sigma = 0.5 + np.arange(len(x)) % 7
    p = read_pattern(write_xy(tmp_path / "a.xye", x, y, sigma))
    np.testing.assert_allclose(p.sigma, np.round(sigma, 3))
    assert p.source["format"] == "xye"


def test_file_wavelength_wins_over_argument_and_argument_fills_a_gap(tmp_path, data):
    x, y = data
    assert (
        read_pattern(write_xy(tmp_path / "a.xy", x, y, wavelength=0.7093), wavelength=1.5406).wavelength
        == 0.7093
    )
    p = read_pattern(write_csv(tmp_path / "b.csv", x, y), wavelength=1.5406)
    assert p.wavelength == 1.5406 and p.source["wavelength_from_file"] is False


def test_csv_with_q_column_is_converted_to_two_theta(tmp_path, data):
    x, y = data
    lam = 1.5406
    q = 4 * np.pi * np.sin(np.radians(x / 2)) / lam
    p = read_pattern(write_csv(tmp_path / "q.csv", q, y, x_name="Q (1/A)"), wavelength=lam)
    np.testing.assert_allclose(p.two_theta, x, atol=1e-5)
    with pytest.raises(PatternFileError, match="give the wavelength"):
        read_pattern(tmp_path / "q.csv")


def test_cps_column_with_counting_time_becomes_counts(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("# counting time = 2.5 s\n# lambda = 0.15406 nm\nangle,cps\n10,4\n10.02,8\n10.04,2\n")
    p = read_pattern(path)
    np.testing.assert_allclose(p.intensity, [10.0, 20.0, 5.0])
    assert p.counting_time == 2.5 and p.intensity_unit == "counts"
    assert p.wavelength == pytest.approx(1.5406)


def test_decreasing_scan_is_reversed(tmp_path, data):
    x, y = data
    p = read_pattern(write_xy(tmp_path / "d.xy", x[::-1], y[::-1]))
    np.testing.assert_allclose(p.two_theta, np.round(x, 4))


def test_xrdml_1_5_start_end_positions_and_wavelengths(tmp_path, data):
    x, y = data
    p = read_pattern(write_xrdml(tmp_path / "a.xrdml", x, y, ka1=1.5405980, ka2=1.5444260, ratio=0.5))
    np.testing.assert_allclose(p.two_theta, np.linspace(round(x[0], 5), round(x[-1], 5), len(x)))
    np.testing.assert_allclose(p.intensity, np.round(y))
    assert (p.wavelength, p.wavelength_ka2, p.ka2_ratio) == (1.5405980, 1.5444260, 0.5)
    assert p.counting_time == 1.0 and p.source["format"] == "xrdml"
    assert p.source["namespace"].endswith("/1.5") and p.source["sample"] == "NaCl-TiO2"


def test_xrdml_1_0_list_positions_and_attenuation(tmp_path, data):
    x, y = data
    att = np.where(y > 3000, 10.0, 1.0)
    p = read_pattern(write_xrdml(tmp_path / "b.xrdml", x, y, legacy=True, attenuation=att))
    np.testing.assert_allclose(p.two_theta, np.round(x, 5))
    np.testing.assert_allclose(p.intensity, np.round(y) * att)
    np.testing.assert_allclose(p.sigma, np.sqrt(np.maximum(np.round(y), 1.0)) * att)


def test_xrdml_counts_per_second_use_the_counting_time(tmp_path, data):
    x, y = data
    path = write_xrdml(tmp_path / "c.xrdml", x, y, counting_time=4.0)
    path.write_text(path.read_text().replace('<counts unit="counts">', '<counts unit="counts/s">'))
    np.testing.assert_allclose(read_pattern(path).intensity, np.round(y) * 4.0)


@pytest.mark.parametrize(
    ("text", "line", "match"),
    [
        ("# t\n10 1\n10.02 x\n", 3, "non-numeric"),
        ("10 1 1\n10.02 2\n", 2, "expected 3 columns"),
        ("10 1\n10.02 nan\n", 2, "non-finite"),
        ("10 1 1\n10.02 2 0\n", 2, "standard deviation"),
        ("10 1\n10.02 2\n10.01 3\n", 3, "does not increase"),
        ("10\n", 1, "two columns"),
    ],
)
def test_malformed_column_files_name_file_and_line(tmp_path, text, line, match):
    path = tmp_path / "bad.xy"
    path.write_text(text)
    with pytest.raises(PatternFileError, match=match) as info:
        read_pattern(path)
    assert info.value.line == line and info.value.path == str(path)
    assert str(info.value).startswith(f"{path}:{line}: ")


def test_malformed_xrdml_names_file_and_line(tmp_path, data):
    x, y = data
    good = write_xrdml(tmp_path / "g.xrdml", x, y).read_text()
    broken = tmp_path / "broken.xrdml"
    broken.write_text(good.replace("</scan>", "", 1))
    with pytest.raises(PatternFileError, match="not well-formed") as info:
        read_pattern(broken)
    assert info.value.line is not None and info.value.line > 1

    lines = good.splitlines()
    counts_line = next(i for i, s in enumerate(lines, start=1) if "<counts " in s)
    nonnumber = tmp_path / "nonnumber.xrdml"
    nonnumber.write_text(good.replace('<counts unit="counts">', '<counts unit="counts">12 abc '))
    with pytest.raises(PatternFileError, match="non-number") as info:
        read_pattern(nonnumber)
    assert info.value.line == counts_line

    no_theta = tmp_path / "no2theta.xrdml"
    no_theta.write_text(good.replace('axis="2Theta"', 'axis="Chi"'))
    with pytest.raises(PatternFileError, match='no <positions axis="2Theta">'):
        read_pattern(no_theta)

    wrong_unit = tmp_path / "unit.xrdml"
    wrong_unit.write_text(good.replace('<kAlpha1 unit="Angstrom">', '<kAlpha1 unit="pm">'))
    with pytest.raises(PatternFileError, match="expected Angstrom"):
        read_pattern(wrong_unit)


def test_unsupported_and_missing_files_raise_typed_errors(tmp_path):
    raw = tmp_path / "scan.raw"
    raw.write_bytes(b"RAW4.00\x00\x00")
    with pytest.raises(PatternFileError, match="Bruker"):
        read_pattern(raw)
    with pytest.raises(PatternFileError, match="no such file"):
        read_pattern(tmp_path / "nope.xy")
    with pytest.raises(ConfigError):  # PatternFileError is a ConfigError (and a ValueError)
        read_pattern(tmp_path / "nope.spc")


def test_pattern_file_error_pickles():
    err = pickle.loads(pickle.dumps(PatternFileError("a.xy", 3, "bad")))
    assert (err.path, err.line, str(err)) == ("a.xy", 3, "a.xy:3: bad")
