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
weighted Chebyshev columns (``fit_linear.LinearProblem``), so every solve is a P × P normal
equation; the trials of a scan (zero shifts, sizes, each phase left out) are
solved as one batch; all claimed phases are rendered together
(``profile.render_phases``) and each (size, zero, strains) once per fit.
``benchmarks/_fit_reference.py`` computes the same fit the straightforward way (full
``lstsq`` per solve); tests hold the two within 1e-7.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from labrl.verifiers.xrd.fit_config import FitConfig, FitResult
from labrl.verifiers.xrd.fit_linear import COARSE_ZERO_STEP, LinearProblem, normal_lstsq, translated
from labrl.verifiers.xrd.fit_v1 import fit_phases_v1
from labrl.verifiers.xrd.library import Phase, resolve_phase
from labrl.verifiers.xrd.mixture import weight_fractions
from labrl.verifiers.xrd.profile import Instrument, chebyshev_basis, phase_sticks, render_phases


@lru_cache(maxsize=2048)
def _sticks(phase_id: str, instrument: Instrument) -> tuple[np.ndarray, np.ndarray]:
    return phase_sticks(resolve_phase(phase_id), instrument)


class _Columns:
    """Phase columns P_p(2θ; zero, a_p, L) of all claimed phases and their projected design (n, P),
    memoised within one fit (the refinement revisits the size it picked)."""

    def __init__(
        self, ids: tuple[str, ...], instrument: Instrument, grid: np.ndarray, problem: LinearProblem
    ):
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
        return fit_phases_v1(
            two_theta, counts, phases, instrument, config, claimed_fractions=claimed_fractions
        )
    grid = np.asarray(two_theta, dtype=float)
    problem = LinearProblem(
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
        coef = normal_lstsq(a.T @ a, a.T @ problem.y_perp, a, problem.y_perp)
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
            n_side = int(np.ceil(config.max_zero_shift / COARSE_ZERO_STEP))
            trials = np.linspace(-config.max_zero_shift, config.max_zero_shift, 2 * n_side + 1)
            # (T, n, P) weighted and projected in one batch
            shifted = problem.project(translated(base, trials, step) * problem.sw[:, None])
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
