"""The straightforward label-free fit, kept as the reference for ``fit.fit_phases``.

Same model and refinement schedule as ``fit`` (see its docstring), computed the
plain way: every phase rendered on its own with a masked window per peak
(``_render``), and every linear solve a fresh ``np.linalg.lstsq`` on the full
weighted design [phase columns | Chebyshev background]. It is several times
slower; tests compare ``fit_phases`` against it (``tests/xrd/test_xrd_fit_fast.py``
loads it by path) and ``benchmarks/xrd_sim.py`` times both in the same run. It
lives beside the benchmark, outside the installed package.
"""

from __future__ import annotations

import math

import numpy as np

from labrl.verifiers.xrd.fit import _sticks
from labrl.verifiers.xrd.fit_config import FitConfig, FitResult
from labrl.verifiers.xrd.fit_linear import COARSE_ZERO_STEP
from labrl.verifiers.xrd.library import load_library
from labrl.verifiers.xrd.mixture import weight_fractions
from labrl.verifiers.xrd.profile import Instrument, chebyshev_basis, rescale_positions

_LN2 = math.log(2.0)


def _render(
    instrument: Instrument,
    two_theta: np.ndarray,
    intensity: np.ndarray,
    crystallite_nm: float,
    grid: np.ndarray,
) -> np.ndarray:
    """``profile.render`` evaluated peak by window with explicit masks (same windows, same formulas)."""
    ok = np.isfinite(two_theta)
    two_theta, intensity = two_theta[ok], intensity[ok]
    positions, weights = [two_theta], [intensity]
    if instrument.ka2_ratio > 0:
        sin2 = np.sin(np.radians(two_theta / 2.0)) * instrument.wavelength_ka2 / instrument.wavelength_ka1
        ok2 = sin2 < 1.0
        positions.append(np.degrees(2.0 * np.arcsin(sin2[ok2])))
        weights.append(intensity[ok2] * instrument.ka2_ratio)
    centres = instrument.shift(np.concatenate(positions))  # (P,)
    areas = np.concatenate(weights)  # (P,)
    fwhm, eta = instrument.fwhm_eta(centres, crystallite_nm)  # (P,), (P,)
    n = len(grid)
    out = np.zeros(n)
    if len(centres) == 0:
        return out
    x0, step = grid[0], grid[1] - grid[0]
    centre_idx = np.rint((centres - x0) / step).astype(np.int64)[:, None]  # (P, 1)
    inv_h = 1.0 / fwhm[:, None]  # (P, 1)
    lor_w = (areas * eta)[:, None] * (2.0 / math.pi) * inv_h
    gau_w = (areas * (1.0 - eta))[:, None] * 2.0 * math.sqrt(_LN2 / math.pi) * inv_h
    for half, lorentz in (
        (math.ceil(instrument.window_fwhm * float(fwhm.max()) / step), True),
        (math.ceil(3.0 * float(fwhm.max()) / step), False),
    ):
        if lorentz and not eta.any():
            continue
        idx = centre_idx + np.arange(-half, half + 1)[None, :]  # (P, K)
        inside = (idx >= 0) & (idx < n)
        dx2 = ((x0 + step * idx - centres[:, None]) * inv_h) ** 2  # (P, K), in units of H
        values = lor_w / (1.0 + 4.0 * dx2) if lorentz else gau_w * np.exp(-4.0 * _LN2 * dx2)
        out += np.bincount(idx[inside], weights=values[inside], minlength=n)
    return out


class _Problem:
    def __init__(self, counts: np.ndarray, basis: np.ndarray):
        self.sw = 1.0 / np.sqrt(np.maximum(counts, 1.0))  # (n,)
        self.yw = counts * self.sw
        self.norm = float(self.yw @ self.yw)
        self.basis_w = basis * self.sw[:, None]  # (n, K)

    def solve(self, columns: list[np.ndarray]) -> tuple[float, np.ndarray, np.ndarray]:
        """(Rwp, phase scales (P,), model (n,)); active set dropping the most negative scale."""
        active = list(range(len(columns)))
        while True:
            a = np.column_stack([*(columns[i] * self.sw for i in active), self.basis_w])  # (n, P' + K)
            coef, *_ = np.linalg.lstsq(a, self.yw, rcond=None)
            if not active or coef[: len(active)].min() >= 0:
                break
            active.pop(int(np.argmin(coef[: len(active)])))
        resid = self.yw - a @ coef
        scales = np.zeros(len(columns))
        scales[active] = coef[: len(active)]
        return float(np.sqrt(resid @ resid / self.norm)), scales, (a @ coef) / self.sw


def fit_phase_ids_reference(
    two_theta: np.ndarray,
    counts: np.ndarray,
    phase_ids: list[str] | tuple[str, ...],
    instrument: Instrument,
    config: FitConfig | None = None,
) -> FitResult:
    """``fit.fit_phase_ids`` computed the straightforward way (slow; for tests and benchmarks)."""
    config = config or FitConfig()
    grid = np.asarray(two_theta, dtype=float)
    problem = _Problem(
        np.asarray(counts, dtype=float), chebyshev_basis(instrument, config.background_degree, grid)
    )
    ids = tuple(load_library().get(pid).id for pid in phase_ids)
    sticks = [_sticks(pid, instrument) for pid in ids]
    rwp_bg = problem.solve([])[0]
    rexp = float(np.sqrt(max(len(grid) - (len(ids) + config.background_degree + 1), 1) / problem.norm))
    strains = {pid: 1.0 for pid in ids}
    size = config.crystallite_grid_nm[len(config.crystallite_grid_nm) // 2]
    zero = 0.0
    dshift_dstrain = -np.degrees(2.0 * np.tan(np.radians(grid / 2.0)))  # (n,)
    step = grid[1] - grid[0]

    def columns(at_size: float, at_zero: float) -> list[np.ndarray]:
        inst = instrument.model_copy(update={"zero_shift": instrument.zero_shift + at_zero})
        wl = instrument.wavelength_ka1
        return [
            _render(inst, rescale_positions(pos, strains[pid], wl), inten, at_size, grid)
            for pid, (pos, inten) in zip(ids, sticks, strict=True)
        ]

    def gauss_newton(cols: list[np.ndarray]) -> None:
        nonlocal zero
        _, scale_arr, _ = problem.solve(cols)
        derivs = [np.gradient(c, step) for c in cols]
        extra = [-sum(s * d for s, d in zip(scale_arr, derivs, strict=True))]
        if config.max_lattice_strain > 0:
            extra += [-s * dshift_dstrain * d for s, d in zip(scale_arr, derivs, strict=True)]
        a = np.column_stack([*(c * problem.sw for c in [*cols, *extra]), problem.basis_w])
        coef, *_ = np.linalg.lstsq(a, problem.yw, rcond=None)
        deltas = coef[len(cols) : len(cols) + len(extra)]
        zero = float(np.clip(zero + deltas[0], -config.max_zero_shift, config.max_zero_shift))
        for i, pid in enumerate(ids):
            if config.max_lattice_strain > 0 and scale_arr[i] > 0:
                lo, hi = 1 - config.max_lattice_strain, 1 + config.max_lattice_strain
                strains[pid] = float(np.clip(strains[pid] + deltas[1 + i], lo, hi))

    if ids:
        base = columns(size, 0.0)
        if config.max_zero_shift > 0:
            n_side = int(np.ceil(config.max_zero_shift / COARSE_ZERO_STEP))
            trials = np.linspace(-config.max_zero_shift, config.max_zero_shift, 2 * n_side + 1)

            def trial_rwp(d: float) -> float:
                return problem.solve([np.interp(grid - d, grid, c, left=0.0, right=0.0) for c in base])[0]

            zero = float(min(trials, key=trial_rwp))
        for _ in range(2):
            gauss_newton(columns(size, zero))
        size = min(config.crystallite_grid_nm, key=lambda s: problem.solve(columns(s, zero))[0])
        gauss_newton(columns(size, zero))

    final = columns(size, zero) if ids else []
    rwp, scale_arr, model = problem.solve(final)
    scales = dict(zip(ids, scale_arr.tolist(), strict=True))
    span = rwp_bg - rexp
    quality = float(np.clip((rwp_bg - rwp) / span, 0.0, 1.0)) if span > 0 else 0.0
    superfluous = tuple(
        pid
        for i, pid in enumerate(ids)
        if span <= 0 or (problem.solve(final[:i] + final[i + 1 :])[0] - rwp) < config.min_gain * span
    )
    return FitResult(
        phase_ids=ids,
        rwp=rwp,
        rwp_background=rwp_bg,
        rexp=rexp,
        scales=scales,
        weight_fractions=weight_fractions(scales, strains),
        zero_shift=zero,
        lattice_scales=strains,
        crystallite_nm=size,
        superfluous=superfluous,
        quality=quality,
        reward=max(0.0, quality - config.penalty * len(superfluous)),
        profile=model,
    )
