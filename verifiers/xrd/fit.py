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

Computation (what keeps a 3-phase fit at a few ms): the background is
eliminated once per measurement by projecting onto the complement of the
weighted Chebyshev columns (``_Problem``), so every solve is a P × P normal
equation; the trials of a scan (zero shifts, sizes, each phase left out) are
solved as one batch; all claimed phases are rendered together
(``profile.render_phases``) and each (size, zero, strains) once per fit.
``benchmarks/_fit_reference.py`` computes the same fit the straightforward way (full
``lstsq`` per solve); tests hold the two within 1e-7.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from labrl.verifiers.xrd.library import Phase, resolve_phase
from labrl.verifiers.xrd.mixture import weight_fractions
from labrl.verifiers.xrd.profile import Instrument, chebyshev_basis, phase_sticks, render_phases

_COARSE_ZERO_STEP = 0.03  # degrees; below the narrowest peak width, so the linearised steps converge


class FitV1Options(BaseModel):
    """Settings of the v1 fit and reward (``fit_v1``); ignored by ``version="v0"``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    size_grid_nm: tuple[float, ...] = (12.0, 20.0, 35.0, 60.0, 100.0, 170.0, 300.0, 600.0, 2000.0)
    microstrain_grid: tuple[float, ...] = (0.0, 0.0005, 0.001, 0.002, 0.004)
    # zero shift and displacement (cos θ) are nearly collinear over a 10-80° scan: off by default
    max_displacement_mm: float = Field(default=0.0, ge=0.0, le=1.0)
    min_significance: float = Field(default=150.0, ge=0.0)
    # count a phase's Δχ² only where its contribution exceeds the other phases' (its own lines)
    unique_lines: bool = True
    fraction_tolerance: float = Field(default=0.03, ge=0.0, le=1.0)
    fraction_scale: float = Field(default=0.2, gt=0.0, le=1.0)
    fraction_weight: float = Field(default=0.5, ge=0.0, le=1.0)
    # one isotropic Debye–Waller B (Å²) per phase, refined in the Gauss–Newton steps from
    # ``b_iso_start`` within [0, ``max_b_iso``]; False: B = 0 (the v1 fit before B was added)
    refine_b_iso: bool = True
    b_iso_start: float = Field(default=0.5, ge=0.0, le=10.0)
    max_b_iso: float = Field(default=3.0, ge=0.0, le=10.0)


class FitConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    background_degree: int = Field(default=4, ge=0, le=12)
    max_zero_shift: float = Field(default=0.12, ge=0.0, le=1.0)
    max_lattice_strain: float = Field(default=0.004, ge=0.0, le=0.05)
    crystallite_grid_nm: tuple[float, ...] = (25.0, 50.0, 100.0, 400.0)
    min_gain: float = Field(default=0.02, ge=0.0, le=1.0)
    penalty: float = Field(default=0.25, ge=0.0, le=1.0)
    # "v0": the fit above, unchanged (``xrd/phase-id-v0`` and ``xrd/tools-v0`` score with it);
    # "v1": ``fit_v1`` (per-phase size and microstrain, displacement, significance test, fractions)
    version: Literal["v0", "v1"] = "v0"
    v1: FitV1Options = Field(default_factory=FitV1Options)


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
    # v1 only (None / empty under v0)
    version: str = "v0"
    crystallite_nm_by_phase: dict[str, float] = field(default_factory=dict)
    microstrain: dict[str, float] = field(default_factory=dict)
    displacement_mm: float | None = None
    significance: dict[str, float] = field(default_factory=dict)
    fraction_mae: float | None = None
    background: np.ndarray | None = field(default=None, repr=False)  # (n,) fitted background
    b_iso: dict[str, float] = field(default_factory=dict)  # refined Debye–Waller B per phase (Å²)

    def summary(self) -> dict[str, object]:
        if self.version != "v0":
            return self._summary_v1()
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

    def _summary_v1(self) -> dict[str, object]:
        return {
            "version": self.version,
            "rwp": round(self.rwp, 5),
            "rwp_background": round(self.rwp_background, 5),
            "rexp": round(self.rexp, 5),
            "weight_fractions": {k: round(v, 4) for k, v in self.weight_fractions.items()},
            "zero_shift": round(self.zero_shift, 4),
            "displacement_mm": None if self.displacement_mm is None else round(self.displacement_mm, 4),
            "lattice_scales": {k: round(v, 5) for k, v in self.lattice_scales.items()},
            "crystallite_nm": {k: round(v, 1) for k, v in self.crystallite_nm_by_phase.items()},
            "microstrain": {k: round(v, 5) for k, v in self.microstrain.items()},
            "b_iso": {k: round(v, 3) for k, v in self.b_iso.items()},
            "significance": {k: round(v, 1) for k, v in self.significance.items()},
            "superfluous": list(self.superfluous),
            "fraction_mae": None if self.fraction_mae is None else round(self.fraction_mae, 4),
            "quality": round(self.quality, 4),
            "reward": round(self.reward, 4),
        }


@lru_cache(maxsize=2048)
def _sticks(phase_id: str, instrument: Instrument) -> tuple[np.ndarray, np.ndarray]:
    return phase_sticks(resolve_phase(phase_id), instrument)


# A normalised Gram matrix whose eigenvalues span more than this ratio (columns with a cosine
# above ~1 − 1e-10) is solved by SVD on the columns instead, which treats near-duplicates as
# ``np.linalg.lstsq`` does.
_GRAM_MIN_RATIO = 1e-10


class _Problem:
    """Weighted linear least squares with non-negative phase scales and a free background.

    The background is eliminated once per measurement: with Q an orthonormal
    basis of the weighted Chebyshev columns B_w, every column and the weighted
    data are projected onto the complement of span(B_w), a ↦ a − Q(Qᵀa). By
    Frisch–Waugh–Lovell the phase coefficients (and the residual) of the
    projected problem equal those of the full one, so each solve only involves
    the P phase columns, through their P × P Gram matrix.
    """

    def __init__(self, counts: np.ndarray, basis: np.ndarray):
        self.y = counts
        self.sw = 1.0 / np.sqrt(np.maximum(counts, 1.0))  # sqrt of weights, (n,)
        self.yw = self.y * self.sw
        self.norm = float(self.yw @ self.yw)
        self.q = _orthonormal(basis * self.sw[:, None])  # (n, K)
        self.y_perp = self.project(self.yw)  # (n,)

    def project(self, a: np.ndarray) -> np.ndarray:
        """Component of ``a`` ((n,), (n, m) or (T, n, m), weighted) orthogonal to the background."""
        return a - self.q @ (self.q.T @ a)

    def design(self, columns: list[np.ndarray]) -> np.ndarray:
        """Weighted, projected phase columns (n, P)."""
        if not columns:
            return np.zeros((len(self.y), 0))
        return self.project(np.column_stack(columns) * self.sw[:, None])

    def rwp(self, resid: np.ndarray) -> float:
        return float(np.sqrt(resid @ resid / self.norm))

    def solve(
        self, design: np.ndarray, gram: np.ndarray | None = None, rhs: np.ndarray | None = None
    ) -> tuple[float, np.ndarray, np.ndarray]:
        """(Rwp, phase scales (P,), weighted residual (n,)) for a projected design (n, P).

        Active set: solve, drop the most negative scale, repeat until none is negative.
        ``gram`` = designᵀdesign and ``rhs`` = designᵀy⊥ may be passed when computed in a batch.
        """
        n_phase = design.shape[1]
        gram = design.T @ design if gram is None else gram  # (P, P)
        rhs = design.T @ self.y_perp if rhs is None else rhs  # (P,)
        active = list(range(n_phase))
        scales = np.zeros(n_phase)
        while active:
            sub = np.ix_(active, active) if len(active) < n_phase else slice(None)
            coef = _lsq(gram[sub], rhs[active], design[:, active], self.y_perp)
            if coef.min() >= 0:
                scales[active] = coef
                break
            active.pop(int(np.argmin(coef)))
        resid = self.y_perp - design @ scales
        return self.rwp(resid), scales, resid

    def rwps(self, designs: np.ndarray) -> np.ndarray:
        """Rwp of ``solve`` for each projected design of a batch (T, n, P): (T,).

        The normal equations of all designs are solved at once, with
        Rwp² = (|y⊥|² − cᵀXᵀy⊥) / Σwy² at the least-squares solution c; designs whose
        solution has a negative scale (or a zero or near-singular column) go through
        ``solve``'s active set one by one.
        """
        n_batch, _, n_phase = designs.shape
        if n_phase == 0:
            return np.full(n_batch, self.rwp(self.y_perp))
        designs_t = designs.transpose(0, 2, 1)  # (T, P, n)
        grams, rhs = designs_t @ designs, designs_t @ self.y_perp  # (T, P, P), (T, P)
        diag = grams.diagonal(axis1=1, axis2=2)  # (T, P)
        inv_norm = 1.0 / np.sqrt(np.where(diag > 0, diag, 1.0))  # (T, P)
        eigval, eigvec = np.linalg.eigh(grams * inv_norm[:, :, None] * inv_norm[:, None, :])
        with np.errstate(divide="ignore", invalid="ignore"):  # singular ones are redone by ``solve``
            along = (eigvec.transpose(0, 2, 1) @ (rhs * inv_norm)[:, :, None])[:, :, 0] / eigval  # (T, P)
            coef = inv_norm * (eigvec @ along[:, :, None])[:, :, 0]  # (T, P)
            fast = (
                (diag > 0).all(axis=1)
                & (eigval[:, 0] > _GRAM_MIN_RATIO * eigval[:, -1])
                & (coef.min(axis=1) >= 0)
            )
            resid2 = self.y_perp @ self.y_perp - (coef * rhs).sum(axis=1)  # (T,)
            out = np.sqrt(np.maximum(resid2, 0.0) / self.norm)
        for t in np.flatnonzero(~fast):
            out[t] = self.solve(designs[t], grams[t], rhs[t])[0]
        return out


def _orthonormal(a: np.ndarray) -> np.ndarray:
    """Q (n, K) with span(Q) = span(a) and QᵀQ = I: Cholesky QR, done twice for orthogonality to ε."""
    for _ in range(2):
        chol = np.linalg.cholesky(a.T @ a)  # aᵀa = L Lᵀ, (K, K)
        a = a @ np.linalg.inv(chol).T  # a L⁻ᵀ
    return a


def _lsq(gram: np.ndarray, rhs: np.ndarray, design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin_c |target − design c|² from the normal equations ``gram c = rhs`` (gram = designᵀdesign).

    Solved on the unit-diagonal Gram D G D (D = diag(G)^(−1/2)) by its eigendecomposition.
    All-zero columns get 0 (the minimum-norm choice); a near-singular rest falls back to
    ``np.linalg.lstsq`` on the columns themselves.
    """
    diag = gram.diagonal()
    if diag.min() <= 0:
        coef = np.zeros(len(rhs))
        live = diag > 0
        if live.any():
            coef[live] = _lsq(gram[np.ix_(live, live)], rhs[live], design[:, live], target)
        return coef
    inv_norm = 1.0 / np.sqrt(diag)
    eigval, eigvec = np.linalg.eigh(gram * np.outer(inv_norm, inv_norm))
    if eigval[0] > _GRAM_MIN_RATIO * eigval[-1]:
        return inv_norm * (eigvec @ ((eigvec.T @ (rhs * inv_norm)) / eigval))
    return np.linalg.lstsq(design, target, rcond=None)[0]


class _Columns:
    """Phase columns P_p(2θ; zero, a_p, L) of all claimed phases and their projected design (n, P),
    memoised within one fit (the refinement revisits the size it picked)."""

    def __init__(self, ids: tuple[str, ...], instrument: Instrument, grid: np.ndarray, problem: _Problem):
        self.ids = ids
        self.instrument = instrument
        self.grid = grid
        self.problem = problem
        self.sticks = [_sticks(pid, instrument) for pid in ids]
        self.cache: dict[tuple[float, float, tuple[float, ...]], tuple[list[np.ndarray], np.ndarray]] = {}

    def get(self, size: float, zero: float, strains: dict[str, float]) -> tuple[list[np.ndarray], np.ndarray]:
        scales = tuple(strains[pid] for pid in self.ids)
        key = (size, zero, scales)
        if key not in self.cache:
            inst = self.instrument.model_copy(update={"zero_shift": self.instrument.zero_shift + zero})
            cols = render_phases(inst, self.sticks, list(scales), crystallite_nm=size, grid=self.grid)
            self.cache[key] = (cols, self.problem.design(cols))
        return self.cache[key]


def _translated(columns: np.ndarray, deltas: np.ndarray, step: float) -> np.ndarray:
    """``columns`` (n, P) sampled at 2θ − δ for each δ (T,): (T, n, P).

    Linear interpolation between grid points and 0 outside the scan: the values of
    ``np.interp(grid − δ, grid, column, left=0, right=0)`` on a uniform grid, where
    point i samples the fractional index i − δ/step.
    """
    n = columns.shape[0]
    # a zero row past the end: with rounding in −δ/step the last sample may sit a hair beyond n − 1
    padded = np.vstack([columns, np.zeros((1, columns.shape[1]))])  # (n + 1, P)
    out = np.zeros((len(deltas), *columns.shape))
    for t, delta in enumerate(deltas):
        shift = -float(delta) / step
        whole = math.floor(shift)
        frac = shift - whole
        first = max(math.ceil(-shift), 0)  # points whose sample lies inside [0, n − 1]
        last = min(math.floor(n - 1 - shift), n - 1)
        if last < first:
            continue
        src = slice(first + whole, last + whole + 1)
        out[t, first : last + 1] = (1.0 - frac) * padded[src]
        if frac:
            out[t, first : last + 1] += frac * padded[first + whole + 1 : last + whole + 2]
    return out


def fit_phases(
    two_theta: np.ndarray,
    counts: np.ndarray,
    phases: list[Phase] | tuple[Phase, ...],
    instrument: Instrument,
    config: FitConfig | None = None,
    *,
    claimed_fractions: dict[str, float] | None = None,
) -> FitResult:
    """Fit ``phases`` to the measurement; see the module docstring. ``instrument`` is the nominal calibration.

    ``config.version == "v1"`` runs ``fit_v1.fit_phases_v1`` instead, which also scores
    ``claimed_fractions`` (phase id -> weight fraction); v0 ignores them.
    """
    config = config or FitConfig()
    if config.version == "v1":
        from labrl.verifiers.xrd.fit_v1 import fit_phases_v1  # fit_v1 builds on this module

        return fit_phases_v1(
            two_theta, counts, phases, instrument, config, claimed_fractions=claimed_fractions
        )
    grid = np.asarray(two_theta, dtype=float)
    problem = _Problem(
        np.asarray(counts, dtype=float), chebyshev_basis(instrument, config.background_degree, grid)
    )
    ids = tuple(p.id for p in phases)
    renderer = _Columns(ids, instrument, grid, problem)
    rwp_bg = problem.rwp(problem.y_perp)
    n_params = len(ids) + config.background_degree + 1
    rexp = float(np.sqrt(max(len(grid) - n_params, 1) / problem.norm))

    strains = {pid: 1.0 for pid in ids}
    size = config.crystallite_grid_nm[len(config.crystallite_grid_nm) // 2]
    zero = 0.0
    # d(2θ)/dε at each grid point for a lattice scale 1 + ε: −(360/π) tan θ
    dshift_dstrain = -np.degrees(2.0 * np.tan(np.radians(grid / 2.0)))  # (n,)
    step = grid[1] - grid[0]

    def gauss_newton(cols: list[np.ndarray], design: np.ndarray) -> None:
        """One linearised update of the zero shift and the lattice strains.

        P(x − δ) ≈ P(x) − δ P'(x): the shifts enter as extra linear columns
        −Σ S_p P'_p (zero shift) and −S_p (dδ/dε) P'_p (strain of phase p).
        """
        nonlocal zero
        _, scale_arr, _ = problem.solve(design)
        derivs = np.gradient(np.column_stack(cols), step, axis=0)  # (n, P)
        extra = [-(derivs @ scale_arr)]
        if config.max_lattice_strain > 0:
            extra += list((-(dshift_dstrain[:, None] * derivs) * scale_arr).T)
        a = np.hstack([design, problem.design(extra)])  # (n, P + 1 [+ P])
        coef = _lsq(a.T @ a, a.T @ problem.y_perp, a, problem.y_perp)
        deltas = coef[len(cols) :]
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
        base = np.column_stack(renderer.get(size, 0.0, strains)[0])  # (n, P)
        # coarse zero shift by translating the rendered columns: brings peaks into the linear regime
        if config.max_zero_shift > 0:
            n_side = int(np.ceil(config.max_zero_shift / _COARSE_ZERO_STEP))
            trials = np.linspace(-config.max_zero_shift, config.max_zero_shift, 2 * n_side + 1)
            # (T, n, P) weighted and projected in one batch
            shifted = problem.project(_translated(base, trials, step) * problem.sw[:, None])
            zero = float(trials[int(np.argmin(problem.rwps(shifted)))])
        for _ in range(2):
            gauss_newton(*renderer.get(size, zero, strains))
        sizes = config.crystallite_grid_nm
        scan = problem.rwps(np.stack([renderer.get(s, zero, strains)[1] for s in sizes]))
        size = sizes[int(np.argmin(scan))]
        gauss_newton(*renderer.get(size, zero, strains))

    design = renderer.get(size, zero, strains)[1] if ids else problem.design([])  # (n, P)
    rwp, scale_arr, resid = problem.solve(design)
    model = (problem.yw - resid) / problem.sw
    scales = dict(zip(ids, scale_arr.tolist(), strict=True))
    span = rwp_bg - rexp
    quality = float(np.clip((rwp_bg - rwp) / span, 0.0, 1.0)) if span > 0 else 0.0
    # Rwp without each claimed phase in turn, (P,)
    without = problem.rwps(np.stack([np.delete(design, i, axis=1) for i in range(len(ids))])) if ids else []
    superfluous = [
        pid
        for pid, rwp_without in zip(ids, without, strict=True)
        if span <= 0 or (rwp_without - rwp) < config.min_gain * span
    ]
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
    claimed_fractions: dict[str, float] | None = None,
) -> FitResult:
    """``fit_phases`` by phase id (picklable arguments, for the process pool)."""
    return fit_phases(
        two_theta,
        counts,
        [resolve_phase(pid) for pid in phase_ids],
        instrument,
        config,
        claimed_fractions=claimed_fractions,
    )
