"""The fast label-free fit agrees with the straightforward reference implementation.

Tolerance: 1e-7 (relative for Rwp, absolute for weight fractions, rewards, zero shift and
lattice scales); the observed deviations on 247 benchmark and ranking fits are below 1e-9.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from pathlib import Path

import numpy as np
import pytest

from labrl.envs.xrd.measure import observe
from labrl.envs.xrd.tasks import PhaseIdConfig, build_task_prompt
from labrl.verifiers.xrd.fit import fit_phase_ids
from labrl.verifiers.xrd.fit_linear import LinearProblem, normal_lstsq, translated
from labrl.verifiers.xrd.library import load_library
from labrl.verifiers.xrd.mixture import Component, Sample, measure
from labrl.verifiers.xrd.profile import (
    Instrument,
    _pseudo_voigt_sum,
    phase_sticks,
    render,
    render_phases,
    rescale_positions,
)

TOL = 1e-7


def _load_reference():
    """``benchmarks/_fit_reference.py``: reference code kept beside its benchmark, outside the package."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "_fit_reference.py"
    spec = importlib.util.spec_from_file_location("labrl_benchmarks_fit_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fit_phase_ids_reference = _load_reference().fit_phase_ids_reference


def _dense_pseudo_voigt(grid, centres, areas, fwhm, eta, window):
    """Every peak on the whole grid, masked to the windows of ``_pseudo_voigt_sum``'s docstring.

    Point i sits at grid[0] + i · (grid[1] − grid[0]), the uniform-grid convention of the renderer.
    """
    step = grid[1] - grid[0]
    idx = np.arange(len(grid))[None, :]  # (1, n)
    nearest = np.rint((centres - grid[0]) / step)[:, None]  # (P, 1)
    x = grid[0] + step * idx - centres[:, None]  # (P, n)
    h = fwhm[:, None]
    lor = (areas * eta)[:, None] * 2.0 / (math.pi * h) / (1.0 + 4.0 * x**2 / h**2)
    gau = (
        (areas * (1 - eta))[:, None]
        * 2.0
        / h
        * math.sqrt(math.log(2) / math.pi)
        * np.exp(-4 * math.log(2) * x**2 / h**2)
    )
    half_l = math.ceil(window * fwhm.max() / step)
    half_g = math.ceil(3.0 * fwhm.max() / step)
    lor = np.where(np.abs(idx - nearest) <= half_l, lor, 0.0) if eta.any() else 0.0 * lor
    gau = np.where(np.abs(idx - nearest) <= half_g, gau, 0.0)
    return (lor + gau).sum(axis=0)


@pytest.mark.parametrize("with_lorentz", [True, False])
def test_pseudo_voigt_sum_matches_dense_evaluation(with_lorentz):
    inst = Instrument()
    grid = inst.grid()
    # peaks inside, at both edges, and outside the scan whose windows still reach it
    centres = np.array([9.7, 10.0, 10.013, 33.3, 33.31, 56.789, 79.99, 80.0, 80.4, 95.0])
    areas = np.linspace(50.0, 500.0, len(centres))
    fwhm, eta = inst.fwhm_eta(centres, 30.0 if with_lorentz else None)
    fast = _pseudo_voigt_sum(grid, centres, areas, fwhm, eta, inst.window_fwhm)
    dense = _dense_pseudo_voigt(grid, centres, areas, fwhm, eta, inst.window_fwhm)
    assert fast.shape == grid.shape
    np.testing.assert_allclose(fast, dense, rtol=0, atol=1e-12 * dense.max())


def test_render_phases_equals_render_per_phase():
    inst = Instrument(zero_shift=0.05, displacement_mm=0.1)
    lib = load_library()
    ids = ["NaCl_225", "TiO2_136", "SiO2_9"]
    sticks = [phase_sticks(lib.get(pid), inst) for pid in ids]
    sticks.append((np.zeros(0), np.zeros(0)))  # a phase without reflections in range
    scales = [1.003, 0.997, 1.0, 1.0]
    for size in (25.0, 400.0, None):  # None: no size broadening, Gaussian peaks only
        batch = render_phases(inst, sticks, scales, crystallite_nm=size)
        assert len(batch) == 4
        for (pos, inten), scale, got in zip(sticks, scales, batch, strict=True):
            want = render(
                inst, rescale_positions(pos, scale, inst.wavelength_ka1), inten, crystallite_nm=size
            )
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * max(want.max(), 1.0))
    assert not batch[3].any()


def test_translated_columns_equal_np_interp():
    grid = 10.0 + 0.02 * np.arange(500)
    cols = np.random.default_rng(0).random((500, 3))
    # the last shift moves every sample off the scan
    deltas = np.array([-0.12, -0.03, 0.0, 0.0071, 0.06, 0.5, 20.0])
    out = translated(cols, deltas, 0.02)
    assert out.shape == (7, 500, 3)
    for t, d in enumerate(deltas):
        for p in range(3):
            want = np.interp(grid - d, grid, cols[:, p], left=0.0, right=0.0)
            np.testing.assert_allclose(out[t, :, p], want, rtol=0, atol=1e-11)
    assert not out[-1].any()


def test_lsq_handles_zero_and_duplicate_columns_like_lstsq():
    rng = np.random.default_rng(1)
    a = rng.random((200, 2))
    design = np.column_stack([a[:, 0], np.zeros(200), a[:, 1], a[:, 1]])  # a zero and a duplicated column
    y = rng.random(200)
    coef = normal_lstsq(design.T @ design, design.T @ y, design, y)
    want = np.linalg.lstsq(design, y, rcond=None)[0]  # minimum norm: 0 and an equal split
    np.testing.assert_allclose(coef, want, rtol=1e-9, atol=1e-12)
    assert coef[1] == 0.0
    assert coef[2] == pytest.approx(coef[3], rel=1e-9)


def _task(seed: int):
    prompt, answer = build_task_prompt(PhaseIdConfig(tier=3), "test", seed)
    obs = observe(prompt["sample"], prompt["noise_seed"], 6, 0)
    inst = Instrument.model_validate(prompt["sample"]["instrument"]).model_copy(
        update={"zero_shift": 0.0, "displacement_mm": 0.0}
    )
    return obs["two_theta"], obs["counts"], tuple(p["id"] for p in answer["phases"]), inst


def _assert_same_fit(fast, ref):
    assert fast.phase_ids == ref.phase_ids
    assert fast.rwp == pytest.approx(ref.rwp, rel=TOL)
    assert fast.rwp_background == pytest.approx(ref.rwp_background, rel=1e-12)
    assert fast.rexp == ref.rexp
    assert fast.reward == pytest.approx(ref.reward, abs=TOL)
    assert fast.quality == pytest.approx(ref.quality, abs=TOL)
    assert fast.superfluous == ref.superfluous
    assert fast.crystallite_nm == ref.crystallite_nm
    assert fast.zero_shift == pytest.approx(ref.zero_shift, abs=TOL)
    assert fast.weight_fractions == pytest.approx(ref.weight_fractions, abs=TOL)
    assert fast.lattice_scales == pytest.approx(ref.lattice_scales, abs=TOL)
    assert fast.scales == pytest.approx(ref.scales, rel=TOL, abs=TOL * max(ref.scales.values(), default=1.0))
    np.testing.assert_allclose(fast.profile, ref.profile, rtol=0, atol=TOL * ref.profile.max())


@pytest.mark.parametrize("seed", [2, 23, 49])  # 49 holds SiO2_9, 660 reflections
def test_fit_matches_reference_on_true_and_wrong_sets(seed):
    two_theta, counts, ids, inst = _task(seed)
    lib = load_library()
    wrong = (*ids[:-1], "Si_227" if "Si_227" not in ids else "NaCl_225")
    extra = (*ids, "TiO2_141" if "TiO2_141" not in ids else "NaCl_225")
    for claim in (ids, wrong, extra, ids[:1]):
        assert all(lib.get(pid) for pid in claim)
        _assert_same_fit(
            fit_phase_ids(two_theta, counts, claim, inst),
            fit_phase_ids_reference(two_theta, counts, claim, inst),
        )


def test_background_only_fit_matches_reference():
    two_theta, counts, _, inst = _task(2)
    fast = fit_phase_ids(two_theta, counts, (), inst)
    _assert_same_fit(fast, fit_phase_ids_reference(two_theta, counts, (), inst))
    assert fast.rwp == pytest.approx(fast.rwp_background, rel=1e-12)
    assert fast.reward == 0.0


def test_batched_rwps_equal_one_by_one_solves_without_warnings():
    rng = np.random.default_rng(2)
    n = 300
    counts = rng.poisson(200.0, n).astype(float)
    problem = LinearProblem(counts, np.vander(np.linspace(-1, 1, n), 3))
    a, b = rng.random(n), rng.random(n)
    designs = np.stack(
        [
            problem.design([a, b]),
            problem.design([a, -b]),  # the second scale comes out negative: active set
            problem.design([a, np.zeros(n)]),  # a phase with no reflections in the scan
            problem.design([a, a]),  # identical columns: falls back to lstsq
        ]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batched = problem.rwps(designs)
    one_by_one = [problem.solve(d)[0] for d in designs]
    np.testing.assert_allclose(batched, one_by_one, rtol=1e-10)
    assert batched[1] == pytest.approx(batched[2], rel=1e-10)  # both reduce to the fit with ``a`` alone


def test_phase_without_reflections_in_the_scan_matches_reference():
    inst = Instrument(two_theta_min=10.0, two_theta_max=20.0)  # NaCl's first reflection is at 27.4°
    sample = Sample(
        components=(Component(phase_id="CdI2_164", weight_fraction=1.0, crystallite_nm=100.0),),
        instrument=inst,
    )
    m = measure(sample, seed=1)
    fast = fit_phase_ids(m.two_theta, m.counts, ("CdI2_164", "NaCl_225"), inst)
    _assert_same_fit(fast, fit_phase_ids_reference(m.two_theta, m.counts, ("CdI2_164", "NaCl_225"), inst))
    assert fast.scales["NaCl_225"] == 0.0
    assert fast.superfluous == ("NaCl_225",)
