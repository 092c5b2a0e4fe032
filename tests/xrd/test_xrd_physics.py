"""v1 physics: anomalous dispersion, Debye–Waller per site, monochromator polarisation, bounded chunks."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from pydantic import ValidationError

import labrl.verifiers.xrd.simulate as simulate
from labrl.errors import ConfigError
from labrl.verifiers.xrd.anomalous import dispersion, line_for
from labrl.verifiers.xrd.library import Phase, load_library
from labrl.verifiers.xrd.mixture import Component
from labrl.verifiers.xrd.profile import Instrument
from labrl.verifiers.xrd.scattering import scattering_table
from labrl.verifiers.xrd.simulate import lorentz_polarization, reflections


def _direct_intensity(
    phase: Phase, hkl: np.ndarray, wavelength: float, anomalous: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(|F(g)|² + |F(−g)|²)·Lp and the Friedel asymmetry |F(g)|² − |F(−g)|², by explicit sums over atoms."""
    recip = np.linalg.inv(phase.lattice).T
    z, coeff = scattering_table().coefficients(list(phase.elements))
    extra = dispersion(phase.elements, wavelength) if anomalous else np.zeros(len(phase.elements))
    out, asym = [], []
    for h in hkl:
        g = np.linalg.norm(h @ recip)
        s2 = (g / 2) ** 2
        f = z - 41.78214 * s2 * (coeff[:, :, 0] * np.exp(-coeff[:, :, 1] * s2)).sum(axis=1) + extra
        pair = [
            abs(
                sum(
                    f[e] * occ * np.exp(2j * math.pi * sign * (h @ r))
                    for r, row in zip(phase.frac_coords, phase.occupancy, strict=True)
                    for e, occ in enumerate(row)
                    if occ
                )
            )
            ** 2
            for sign in (1, -1)
        ]
        theta = math.asin(wavelength * g / 2)
        out.append(sum(pair) * lorentz_polarization(np.array([theta]))[0])
        asym.append((pair[0] - pair[1]) / max(sum(pair), 1e-300))
    return np.array(out), np.array(asym)


def test_anomalous_intensities_equal_a_direct_sum_and_break_friedel_pairs():
    zno = load_library("v1").get("ZnO_186_hP4")
    refl = reflections(zno, wavelength=1.54056, two_theta_range=(20, 80), anomalous=True)
    direct, asym = _direct_intensity(zno, refl.hkl, 1.54056, anomalous=True)
    np.testing.assert_allclose(refl.intensity, direct, rtol=1e-10, atol=1e-12 * direct.max())
    plain = reflections(zno, wavelength=1.54056, two_theta_range=(20, 80))
    strong = plain.intensity > 1e-6 * plain.intensity.max()
    assert np.abs(refl.intensity[strong] / plain.intensity[strong] - 1).max() > 0.01
    # ZnO is polar: with f″ ≠ 0 Friedel mates differ; the powder sums both
    assert np.abs(asym[strong]).max() > 1e-3
    _, asym_plain = _direct_intensity(zno, refl.hkl, 1.54056, anomalous=False)
    assert np.abs(asym_plain[strong]).max() < 1e-9


def test_dispersion_table_values_and_errors():
    fe = dispersion(["Fe"], 1.54056)[0]  # International Tables Vol. C: f′ = −1.179, f″ = 3.204
    assert fe.real == pytest.approx(-1.18, abs=0.05) and fe.imag == pytest.approx(3.20, abs=0.05)
    assert line_for(0.7093) == "MoKa1" and line_for(1.5444) == "CuKa2"
    with pytest.raises(ConfigError, match="no anomalous-dispersion table"):
        line_for(1.0)
    with pytest.raises(ValidationError):
        Instrument(anomalous_dispersion=True, wavelength_ka1=1.0, wavelength_ka2=1.003)


def test_site_debye_waller_equals_element_b_and_matches_formula():
    phase = load_library("v1").get("CaCO3_167_hR10")
    b = {"Ca": 0.6, "C": 0.4, "O": 0.9}
    per_element = reflections(phase, debye_waller=b)
    site_b = np.array([b[phase.elements[int(np.argmax(row))]] for row in phase.occupancy])
    per_site = reflections(phase, site_b=site_b)
    top = per_element.intensity.max()  # extinct reflections are ~1e-25 of it: compare on that scale
    np.testing.assert_allclose(per_site.intensity, per_element.intensity, rtol=1e-10, atol=1e-12 * top)
    # one B for all atoms scales every intensity by exp(−2 B s²)
    uniform = reflections(phase, site_b=np.full(len(phase.frac_coords), 0.5))
    s2 = (np.linalg.norm(uniform.g_cart, axis=1) / 2) ** 2
    np.testing.assert_allclose(
        uniform.intensity, reflections(phase).intensity * np.exp(-2 * 0.5 * s2), rtol=1e-10, atol=1e-12 * top
    )
    with pytest.raises(ConfigError, match="site_b"):
        reflections(phase, site_b=np.zeros(3))


def test_monochromator_polarization():
    phase = load_library("v1").get("Si_227_cF8")
    free = reflections(phase, wavelength=1.54056)
    mono = reflections(phase, wavelength=1.54056, monochromator_two_theta=26.55)
    two_theta = np.radians(free.two_theta)
    cm2 = math.cos(math.radians(26.55)) ** 2
    expected = 2 * (1 + cm2 * np.cos(two_theta) ** 2) / (1 + cm2) / (1 + np.cos(two_theta) ** 2)
    strong = free.intensity > 1e-9 * free.intensity.max()  # (200) etc. are extinct in diamond
    assert strong.sum() > 5
    np.testing.assert_allclose(mono.intensity[strong] / free.intensity[strong], expected[strong], rtol=1e-12)
    zero = reflections(phase, wavelength=1.54056, monochromator_two_theta=0.0)
    np.testing.assert_allclose(zero.intensity, free.intensity, rtol=1e-12, atol=1e-15 * free.intensity.max())


def test_new_fields_stay_out_of_v0_dumps():
    assert "anomalous_dispersion" not in Instrument().model_dump()
    assert "monochromator_two_theta" not in Instrument().model_dump(mode="json")
    on = Instrument(anomalous_dispersion=True, monochromator_two_theta=26.55).model_dump()
    assert on["anomalous_dispersion"] is True and on["monochromator_two_theta"] == 26.55
    assert "b_iso" not in Component(phase_id="x", weight_fraction=1.0).model_dump()
    assert Component(phase_id="x", weight_fraction=1.0, b_iso=0.4).model_dump()["b_iso"] == 0.4


def test_chunk_size_does_not_change_results(monkeypatch):
    phase = load_library("v1").get("Y2O3_206_cI80")
    whole = reflections(phase, wavelength=0.7093, anomalous=True, two_theta_range=(5, 60))
    monkeypatch.setattr(simulate, "CHUNK_ELEMENTS", 97)
    chunked = reflections(phase, wavelength=0.7093, anomalous=True, two_theta_range=(5, 60))
    np.testing.assert_array_equal(chunked.hkl, whole.hkl)
    np.testing.assert_allclose(
        chunked.intensity, whole.intensity, rtol=1e-10, atol=1e-12 * whole.intensity.max()
    )


def test_576_atom_cell_with_mo_runs_in_bounded_memory():
    base = load_library("v1").get("Y2O3_206_cI80")  # 80 atoms: 576 of a 2x2x2 supercell (640)
    cells = np.array([[i, j, k] for i in range(2) for j in range(2) for k in range(2)])
    frac = ((base.frac_coords[None, :, :] + cells[:, None, :]) / 2.0).reshape(-1, 3)[:576]
    occupancy = np.tile(base.occupancy, (8, 1))[:576]
    big = Phase(
        id="big", formula="Y2O3", spacegroup_symbol="P1", spacegroup_number=1, crystal_system="triclinic",
        elements=base.elements, lattice=base.lattice * 2.0, frac_coords=frac, occupancy=occupancy,
        cell_mass=1.0, volume=float(abs(np.linalg.det(base.lattice * 2.0))), source="test",
    )  # fmt: skip
    tracemalloc.start()
    refl = reflections(big, wavelength=0.7093, two_theta_range=(5.0, 60.0))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(refl.hkl) > 50_000
    assert peak < 100e6  # all reflections x sites at once: 0.5 GB per complex temporary, several of them
