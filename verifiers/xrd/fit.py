"""Label-free scoring: fit the claimed phases to the measured pattern, as a lab would.

Model of the observed counts y (n,) with the claimed phases p::

    ŷ = Σ_p S_p · P_p(2θ; zero, a_p, L) + Σ_k c_k T_k(x)

P_p is the phase profile (``profile.render``) with the lattice scaled by a_p
and a global crystallite size L, T_k Chebyshev background terms. For fixed
(zero, a, L) the model is linear: S_p ≥ 0 and c_k free are solved by weighted
least squares with w_i = 1 / max(y_i, 1) (an active set drops phases whose
scale comes out negative). The few nonlinear parameters are refined around
that linear solve: a coarse zero-shift scan (translating the columns), two
Gauss–Newton steps on the zero shift and the strains a_p (P(x − δ) ≈ P − δ P',
so the shifts enter as extra linear columns; a_p kept within
±``max_lattice_strain``), L chosen on a grid, and one more Gauss–Newton step.

Figures of merit::

    Rwp  = sqrt( Σ w (y − ŷ)² / Σ w y² )
    Rexp = sqrt( (n − n_params) / Σ w y² )          (the Rwp of a perfect model)

Reward (in [0, 1])::

    quality  = clip( (Rwp_bg − Rwp) / (Rwp_bg − Rexp), 0, 1 )
    reward   = max(0, quality − penalty · n_superfluous)

Rwp_bg is the background-only fit; a claimed phase is superfluous when
removing it raises Rwp by less than ``min_gain`` of (Rwp_bg − Rexp): it does
not explain any of the signal. Weight fractions come from the fitted scales
by Hill–Howard (``mixture.weight_fractions``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from labrl.verifiers.xrd.library import Phase, load_library
from labrl.verifiers.xrd.mixture import weight_fractions
from labrl.verifiers.xrd.profile import Instrument, chebyshev_basis, phase_sticks, render, rescale_positions

_COARSE_ZERO_STEP = 0.03  # degrees; below the narrowest peak width, so the linearised steps converge


class FitConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    background_degree: int = Field(default=4, ge=0, le=12)
    max_zero_shift: float = Field(default=0.12, ge=0.0, le=1.0)
    max_lattice_strain: float = Field(default=0.004, ge=0.0, le=0.05)
    crystallite_grid_nm: tuple[float, ...] = (25.0, 50.0, 100.0, 400.0)
    min_gain: float = Field(default=0.02, ge=0.0, le=1.0)
    penalty: float = Field(default=0.25, ge=0.0, le=1.0)


@dataclass(frozen=True)
class FitResult:
    phase_ids: tuple[str, ...]
    rwp: float
    rwp_background: float
    rexp: float
    scales: dict[str, float]
    weight_fractions: dict[str, float]
    zero_shift: float
    lattice_scales: dict[str, float]
    crystallite_nm: float
    superfluous: tuple[str, ...]
    quality: float
    reward: float
    profile: np.ndarray = field(repr=False)  # (n,) fitted model

    def summary(self) -> dict[str, object]:
        return {
            "rwp": round(self.rwp, 5),
            "rwp_background": round(self.rwp_background, 5),
            "rexp": round(self.rexp, 5),
            "weight_fractions": {k: round(v, 4) for k, v in self.weight_fractions.items()},
            "zero_shift": round(self.zero_shift, 4),
            "lattice_scales": {k: round(v, 5) for k, v in self.lattice_scales.items()},
            "crystallite_nm": self.crystallite_nm,
            "superfluous": list(self.superfluous),
            "quality": round(self.quality, 4),
            "reward": round(self.reward, 4),
        }


@lru_cache(maxsize=2048)
def _sticks(phase_id: str, instrument: Instrument) -> tuple[np.ndarray, np.ndarray]:
    return phase_sticks(load_library().get(phase_id), instrument)


class _Problem:
    """Weighted linear least squares with non-negative phase scales and a free background."""

    def __init__(self, counts: np.ndarray, basis: np.ndarray):
        self.y = counts
        self.sw = 1.0 / np.sqrt(np.maximum(counts, 1.0))  # sqrt of weights, (n,)
        self.yw = self.y * self.sw
        self.norm = float(self.yw @ self.yw)
        self.basis_w = basis * self.sw[:, None]  # (n, K)

    def solve(self, columns: list[np.ndarray]) -> tuple[float, np.ndarray, np.ndarray]:
        """(Rwp, phase scales (P,), model (n,)) for phase columns (each (n,))."""
        n_phase = len(columns)
        active = list(range(n_phase))
        while True:
            cols = [columns[i] * self.sw for i in active]
            a = np.column_stack([*cols, self.basis_w]) if cols else self.basis_w  # (n, P' + K)
            coef, *_ = np.linalg.lstsq(a, self.yw, rcond=None)
            phase_coef = coef[: len(active)]
            if len(active) == 0 or phase_coef.min() >= 0:
                break
            active.pop(int(np.argmin(phase_coef)))
        resid = self.yw - a @ coef
        scales = np.zeros(n_phase)
        scales[active] = phase_coef
        model = (a @ coef) / self.sw
        return float(np.sqrt(resid @ resid / self.norm)), scales, model


def _shifted(column: np.ndarray, grid: np.ndarray, delta: float) -> np.ndarray:
    return np.interp(grid - delta, grid, column, left=0.0, right=0.0) if delta else column


def fit_phases(
    two_theta: np.ndarray,
    counts: np.ndarray,
    phases: list[Phase] | tuple[Phase, ...],
    instrument: Instrument,
    config: FitConfig | None = None,
) -> FitResult:
    """Fit ``phases`` to the measurement; see the module docstring. ``instrument`` is the nominal calibration."""
    config = config or FitConfig()
    grid = np.asarray(two_theta, dtype=float)
    problem = _Problem(
        np.asarray(counts, dtype=float), chebyshev_basis(instrument, config.background_degree, grid)
    )
    ids = tuple(p.id for p in phases)
    sticks = [_sticks(pid, instrument) for pid in ids]
    wl = instrument.wavelength_ka1
    rwp_bg, _, _ = problem.solve([])
    n_params = len(ids) + config.background_degree + 1
    rexp = float(np.sqrt(max(len(grid) - n_params, 1) / problem.norm))

    strains = {pid: 1.0 for pid in ids}
    size = config.crystallite_grid_nm[len(config.crystallite_grid_nm) // 2]
    zero = 0.0
    # d(2θ)/dε at each grid point for a lattice scale 1 + ε: −(360/π) tan θ
    dshift_dstrain = -np.degrees(2.0 * np.tan(np.radians(grid / 2.0)))  # (n,)
    step = grid[1] - grid[0]

    def columns(at_size: float, at_zero: float, strain: dict[str, float]) -> list[np.ndarray]:
        inst = instrument.model_copy(update={"zero_shift": instrument.zero_shift + at_zero})
        return [
            render(inst, rescale_positions(pos, strain[pid], wl), inten, crystallite_nm=at_size, grid=grid)
            for pid, (pos, inten) in zip(ids, sticks, strict=True)
        ]

    def gauss_newton(cols: list[np.ndarray]) -> None:
        """One linearised update of the zero shift and the lattice strains.

        P(x − δ) ≈ P(x) − δ P'(x): the shifts enter as extra linear columns
        −Σ S_p P'_p (zero shift) and −S_p (dδ/dε) P'_p (strain of phase p).
        """
        nonlocal zero
        _, scale_arr, _ = problem.solve(cols)
        derivs = [np.gradient(c, step) for c in cols]
        extra = [-sum(s * d for s, d in zip(scale_arr, derivs, strict=True))]
        if config.max_lattice_strain > 0:
            extra += [-s * dshift_dstrain * d for s, d in zip(scale_arr, derivs, strict=True)]
        a = np.column_stack(
            [*(c * problem.sw for c in cols), *(e * problem.sw for e in extra), problem.basis_w]
        )
        coef, *_ = np.linalg.lstsq(a, problem.yw, rcond=None)
        deltas = coef[len(cols) : len(cols) + len(extra)]
        zero = float(np.clip(zero + deltas[0], -config.max_zero_shift, config.max_zero_shift))
        for i, pid in enumerate(ids):
            if config.max_lattice_strain > 0 and scale_arr[i] > 0:
                strains[pid] = float(
                    np.clip(
                        strains[pid] + deltas[1 + i],
                        1 - config.max_lattice_strain,
                        1 + config.max_lattice_strain,
                    )
                )

    if ids:
        base = columns(size, 0.0, strains)
        # coarse zero shift by translating the rendered columns: brings peaks into the linear regime
        if config.max_zero_shift > 0:
            n_side = int(np.ceil(config.max_zero_shift / _COARSE_ZERO_STEP))
            trials = np.linspace(-config.max_zero_shift, config.max_zero_shift, 2 * n_side + 1)
            zero = float(min(trials, key=lambda d: problem.solve([_shifted(c, grid, d) for c in base])[0]))
        for _ in range(2):
            gauss_newton(columns(size, zero, strains))
        size = min(config.crystallite_grid_nm, key=lambda s: problem.solve(columns(s, zero, strains))[0])
        gauss_newton(columns(size, zero, strains))

    final_cols = columns(size, zero, strains) if ids else []
    rwp, scale_arr, model = problem.solve(final_cols)
    scales = dict(zip(ids, scale_arr.tolist(), strict=True))
    span = rwp_bg - rexp
    quality = float(np.clip((rwp_bg - rwp) / span, 0.0, 1.0)) if span > 0 else 0.0
    superfluous = []
    for i, pid in enumerate(ids):
        without = problem.solve(final_cols[:i] + final_cols[i + 1 :])[0]
        if span <= 0 or (without - rwp) < config.min_gain * span:
            superfluous.append(pid)
    reward = max(0.0, quality - config.penalty * len(superfluous))
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
        superfluous=tuple(superfluous),
        quality=quality,
        reward=reward,
        profile=model,
    )


def fit_phase_ids(
    two_theta: np.ndarray,
    counts: np.ndarray,
    phase_ids: list[str] | tuple[str, ...],
    instrument: Instrument,
    config: FitConfig | None = None,
) -> FitResult:
    """``fit_phases`` by phase id (picklable arguments, for the process pool)."""
    library = load_library()
    return fit_phases(two_theta, counts, [library.get(pid) for pid in phase_ids], instrument, config)
