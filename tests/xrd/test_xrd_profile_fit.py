"""Instrument model, Hill–Howard mixtures and the label-free fit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from labrl.verifiers.xrd.fit import fit_phase_ids
from labrl.verifiers.xrd.library import load_library
from labrl.verifiers.xrd.mixture import Component, Sample, expected_pattern, measure, weight_fractions
from labrl.verifiers.xrd.profile import Instrument, march_dollase, render


def test_pseudo_voigt_area_and_doublet_position():
    inst = Instrument(ka2_ratio=0.5, window_fwhm=200.0)
    centre = 40.0
    profile = render(inst, np.array([centre]), np.array([1000.0]), crystallite_nm=50.0)
    # area = intensity × (1 + Kα2 ratio); the Lorentzian tail beyond ±200 H is negligible but not zero
    assert profile.sum() * inst.step == pytest.approx(1500.0, rel=5e-3)
    sin2 = math.sin(math.radians(centre / 2)) * inst.wavelength_ka2 / inst.wavelength_ka1
    ka2 = math.degrees(2 * math.asin(sin2))
    sharp = render(inst, np.array([centre]), np.array([1000.0]), crystallite_nm=None)  # resolved doublet
    grid = inst.grid()
    right = grid > (centre + ka2) / 2
    assert grid[right][np.argmax(sharp[right])] == pytest.approx(ka2, abs=inst.step)
    assert sharp[right].max() == pytest.approx(0.5 * sharp.max(), rel=0.05)


def test_zero_shift_and_displacement_move_peaks():
    inst = Instrument(ka2_ratio=0.0, zero_shift=0.1, displacement_mm=0.2)
    theta = math.radians(30.0 / 2)
    expected = 30.0 + 0.1 - math.degrees(2 * 0.2 * math.cos(theta) / 240.0)
    assert inst.shift(np.array([30.0]))[0] == pytest.approx(expected, abs=1e-12)


def test_march_dollase_by_hand():
    g = np.array([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
    p = march_dollase(g, np.array([0.0, 0.0, 2.0]), 0.8)
    # α = 0: r^-3; α = 90°: r^1.5; α = 45°: (r²/2 + 1/(2r))^-1.5
    np.testing.assert_allclose(p, [0.8**-3, 0.8**1.5, (0.32 + 0.625) ** -1.5], rtol=1e-12)


def test_fit_recovers_hill_howard_weight_fractions():
    truth = {"NaCl_225": 0.5, "TiO2_136": 0.3, "Al2O3_167": 0.2}
    sample = Sample(
        components=tuple(
            Component(phase_id=k, weight_fraction=v, crystallite_nm=100.0) for k, v in truth.items()
        ),
        peak_counts=50_000,
    )
    m = measure(sample, seed=3)
    fit = fit_phase_ids(m.two_theta, m.counts, tuple(truth), sample.instrument)
    for pid, w in truth.items():
        assert fit.weight_fractions[pid] == pytest.approx(w, abs=0.02)
    assert fit.rwp < 1.3 * fit.rexp
    assert fit.superfluous == ()
    assert fit.reward > 0.95


def test_weight_fraction_inversion_is_exact():
    lib = load_library()
    scales = {"NaCl_225": 1.0 / (lib.get("NaCl_225").cell_mass * lib.get("NaCl_225").volume) * 0.25,
              "TiO2_136": 1.0 / (lib.get("TiO2_136").cell_mass * lib.get("TiO2_136").volume) * 0.75}  # fmt: skip
    assert weight_fractions(scales) == pytest.approx({"NaCl_225": 0.25, "TiO2_136": 0.75})


def test_label_free_penalises_wrong_and_extra_phases():
    sample = Sample(
        components=(
            Component(phase_id="NaCl_225", weight_fraction=0.6, crystallite_nm=100.0),
            Component(phase_id="TiO2_136", weight_fraction=0.4, crystallite_nm=100.0),
        )
    )
    m = measure(sample, seed=0)
    reward = lambda ids: fit_phase_ids(m.two_theta, m.counts, ids, sample.instrument).reward  # noqa: E731
    true = reward(("NaCl_225", "TiO2_136"))
    assert true > reward(("NaCl_225", "TiO2_141"))  # wrong polymorph
    assert true > reward(("NaCl_225",))  # missing phase
    extra = fit_phase_ids(m.two_theta, m.counts, ("NaCl_225", "TiO2_136", "Si_227"), sample.instrument)
    assert extra.superfluous == ("Si_227",)
    assert true > extra.reward


def test_measurement_is_deterministic_and_poisson():
    sample = Sample(components=(Component(phase_id="NaCl_225", weight_fraction=1.0),))
    a, b = measure(sample, 7), measure(sample, 7)
    np.testing.assert_array_equal(a.counts, b.counts)
    _, expected, _ = expected_pattern(sample)
    z = (a.counts - expected) / np.sqrt(expected)
    assert abs(z.mean()) < 0.1 and 0.9 < z.std() < 1.1
