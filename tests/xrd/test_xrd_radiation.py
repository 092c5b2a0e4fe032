"""The incident beam: radiation names, the rules of ``beam_hypotheses`` and typed errors for bad input."""

from __future__ import annotations

import pytest

from labrl.errors import ConfigError
from labrl.verifiers.xrd.anomalous import ANODE_LINES
from labrl.verifiers.xrd.radiation import RADIATIONS, beam_hypotheses, parse_radiation

CU_KA1, CU_KA2 = ANODE_LINES["Cu"]


def _beams(*args, **kwargs) -> list[tuple[float, float, float]]:
    return [(b.ka1, b.ka2, b.ratio) for b in beam_hypotheses(*args, **kwargs).beams]


def test_radiation_names_give_the_doublet_or_ka1_alone():
    assert parse_radiation("CuKa") == ("Cu", False)
    assert parse_radiation("cukα1") == ("Cu", True)
    assert parse_radiation("Mo Ka1") == ("Mo", True)
    assert len(RADIATIONS) == 2 * len(ANODE_LINES) and "CoKa1" in RADIATIONS
    assert _beams(None, radiation="CuKa") == [(CU_KA1, CU_KA2, 0.5)]
    assert _beams(None, radiation="MoKa1") == [(ANODE_LINES["Mo"][0],) * 2 + (0.0,)]
    hyp = beam_hypotheses(None, radiation="CoKa1", wavelength=ANODE_LINES["Co"][0])
    assert hyp.source == "radiation" and hyp.beams[0].single_line


def test_an_anode_ka1_alone_is_both_hypotheses_and_its_mean_is_the_doublet():
    hyp = beam_hypotheses(None, wavelength=1.5406)
    assert [(b.ka1, b.ka2, b.ratio) for b in hyp.beams] == [(CU_KA1, CU_KA2, 0.5), (CU_KA1, CU_KA1, 0.0)]
    assert "chosen by Rwp" in hyp.source
    # Cu Kα1 and the mean are 0.0013 Å apart, inside the 0.002 Å tolerance: the nearer decides
    assert _beams(None, wavelength=(2 * CU_KA1 + CU_KA2) / 3) == [(CU_KA1, CU_KA2, 0.5)]
    assert _beams(1.5406) == [(1.5406, CU_KA2, 0.5), (1.5406, 1.5406, 0.0)]  # a file's λ alone


@pytest.mark.parametrize("wavelength", [0.8265, 0.4128, 0.1665, 1.0, 1.5500])
def test_a_synchrotron_wavelength_never_gets_a_doublet(wavelength):
    hyp = beam_hypotheses(None, wavelength=wavelength)
    assert _beams(None, wavelength=wavelength) == [(wavelength, wavelength, 0.0)]
    assert hyp.source == "wavelength" and hyp.beams[0].label.startswith("monochromatic")


def test_the_file_keeps_priority_and_contradictions_are_typed_errors():
    assert _beams(1.540598, 1.544426, 0.5) == [(1.540598, 1.544426, 0.5)]
    assert _beams(1.540598, 1.544426, 0.5, radiation="CuKa").pop() == (1.540598, 1.544426, 0.5)
    assert _beams(1.540598, None, 0.0, radiation="CuKa1") == [(1.540598, 1.540598, 0.0)]
    # XRDML from a Kα1-monochromated instrument still states the tube's Kα2: --radiation CuKa1 wins
    hyp = beam_hypotheses(1.540598, 1.544426, 0.5, radiation="CuKa1")
    assert [(b.ka1, b.ka2, b.ratio) for b in hyp.beams] == [(1.540598, 1.540598, 0.0)]
    assert hyp.source == "radiation (overrides the file's Kα2/Kα1 0.5)"
    back = beam_hypotheses(1.540598, None, 0.0, radiation="CuKa")
    assert back.beams[0].ratio == 0.5 and back.beams[0].ka1 == 1.540598 and "overrides" in back.source
    with pytest.raises(ConfigError, match="not the Kα1 of --radiation MoKa"):
        beam_hypotheses(1.540598, radiation="MoKa")
    with pytest.raises(ConfigError, match=r"file states λ = 1\.5406"):
        beam_hypotheses(1.5406, wavelength=0.7093)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"radiation": "CuKb"}, "unknown radiation 'CuKb'"),
        ({"radiation": "WKa"}, "unknown radiation 'WKa': use one of CrKa, CrKa1"),
        ({"wavelength": 8.04}, "outside 0.05-5 Å"),  # Cu Kα in keV
        ({"wavelength": 154.06}, "outside 0.05-5 Å"),  # in pm
        ({"wavelength": -1.5}, "outside"),
        ({"wavelength": 1.0, "radiation": "CuKa"}, "not the Kα1 of --radiation CuKa"),
        ({}, "give --wavelength"),
    ],
)
def test_bad_beam_input_is_a_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        beam_hypotheses(None, **kwargs)
