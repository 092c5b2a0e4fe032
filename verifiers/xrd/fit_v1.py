"""The v1 fit and reward (``FitConfig(version="v1")``): what ``labrl xrd identify`` and the v1 envs use.

Model of the observed counts y (n,) with the claimed phases p::

    ŷ(2θ) = Σ_p S_p · P_p(2θ; zero, s, a_p, L_p, ε_p) + Σ_k c_k T_k(x)

as in v0 (``fit``), but every phase has its own crystallite size L_p and
microstrain ε_p, and the peaks also move with the sample displacement s (mm)::

    2θ_obs = 2θ + zero − (180/π) · 2 s cos θ / R

    H_L(p) = (180/π) · [ K λ / (L_p cos θ) + 4 ε_p tan θ ]     (Scherrer + Williamson–Hall,
                                                                 Lorentzian widths add)

S_p ≥ 0 and the Chebyshev c_k are linear (weighted least squares, w = 1/max(y, 1),
active set on the S_p). The nonlinear parameters are refined around that solve:
a coarse zero-shift scan, two Gauss–Newton steps on (zero, s, a_p, B_p)
(P(x − δ) ≈ P − δ P'), a coordinate-descent scan of each L_p on
``size_grid_nm`` and then of each ε_p on ``microstrain_grid`` (the other
phases held), and a last Gauss–Newton step.

Debye–Waller: every phase p has one isotropic B_p (Å²), so each of its Kα1
sticks k (at s_k = sin θ_k / λ₁) has intensity I_k · exp(−2 B_p s_k²), exactly
what the simulator gives for ``Component.b_iso`` (the amplitude factor
exp(−B s²) is common to all atoms, f′ and f″ included). B_p starts at
``b_iso_start`` and is refined in the Gauss–Newton steps within
[0, ``max_b_iso``] with the column derivative
∂P_p/∂B_p = render of the sticks I_k · (−2 s_k²) · exp(−2 B_p s_k²).
The instrument's anomalous dispersion and monochromator polarisation are in
the sticks themselves (``phase_sticks``), as in the measurement.

Weight fractions from the scales (Hill & Howard 1987, the ZMV rule)::

    w_p = S_p (Z M V)_p / Σ_q S_q (Z M V)_q

Z M is the mass of the cell contents (``Phase.cell_mass``, amu) and V the
refined cell volume V₀ a_p³ (Å³). Absorption contrast is not modelled.

Reward::

    χ² = Σ w (y − ŷ)² = Rwp² Σ w y²,      χ²_ν = χ² / (n − n_params)
    quality   = clip( 1 − (Rwp² − Rexp²) / (Rwp_bg² − Rexp²), 0, 1 )
    U_p       = { i : S_p P_p,i > Σ_{q≠p} S_q P_q,i }       (where p's own lines dominate)
    Q_p,i     = P_p,i [i ∈ U_p]   (P_p,i when U_p is empty or ``unique_lines`` is off)
    χ²_ν(p)   = max( 1, χ²_ν, (n/(n − n_params)) Σ_i Q_p,i r_i² / Σ_i Q_p,i )   (r: weighted residual)
    Δχ²_p     = min( Σ_{i∈U_p} ( r_i,without p² − r_i² ),  χ²_without p − χ² )
    F_p       = ( Δχ²_p / k_p ) / χ²_ν(p)                   (significance of phase p)
    superfluous: F_p ≤ F⁻¹_{k_p, n − n_params}( 1 − ``significance_level`` )
    MAE       = mean_p | w_claimed(p) − w_fit(p) |      (claimed fractions normalised to sum 1)
    f         = 1 − fraction_weight · clip( (MAE − fraction_tolerance) / fraction_scale, 0, 1 )
    reward    = max(0, quality · f − penalty · n_superfluous)

``quality`` is the share of the pattern's χ² above counting noise (background-only
χ² minus its expectation n − n_params) that the phases explain. Δχ²_p is the rise of
χ² when p is removed, counted only over the points where p's fitted contribution
exceeds all other phases' together (its own lines) and never above the rise over the
whole scan; χ²_ν(p) is the misfit scale over the same points (the profile-weighted
mean of r² there, at least the global χ²_ν and at least 1, pure counting noise), so a
minor phase whose other lines sit under a major phase's misfit is not measured against
that misfit. F_p is an
F-test (Hamilton's R-ratio test on Rwp) of the k_p parameters of phase p (scale,
lattice, size, strain, and B when refined): if p were absent, its k_p parameters would
lower χ² by counting noise alone, k_p F_p ~ χ²(k_p), i.e. F_p ~ F(k_p, n − n_params); a phase is kept
when the rise of χ² without it is larger than counting noise explains at the level
``significance_level``. A weak but real phase with lines of its own is kept however
small its share of Rwp; a phase whose peaks sit on another phase's peaks and only
soak up that phase's misfit (an isostructural decoy) has no points of its own
and is flagged. ``unique_lines=False`` counts Δχ² over the whole scan. f = 1 when no fractions are claimed.

Only a superfluous phase is penalised, so the reward never ranks a fit with a significant
extra phase below the same fit without it: the extra phase lowers χ² by more than k_p F_crit χ²_ν(p),
which is more than k_p (F_crit > 1 at ``significance_level`` ≤ 0.05, χ²_ν(p) ≥ 1); with
u = χ² − ν and v = χ²_bg − ν, quality rises when Δχ² > k_p (1 − u/v), so it rises.
"The same fit without it" is the linear solve without p at the same nonlinear parameters.
"""

from __future__ import annotations

import numpy as np

from labrl.verifiers.xrd.fit_config import FitConfig, FitResult
from labrl.verifiers.xrd.fit_linear import COARSE_ZERO_STEP, LinearProblem, normal_lstsq, translated
from labrl.verifiers.xrd.library import Phase
from labrl.verifiers.xrd.profile import Instrument, chebyshev_basis, phase_sticks, render_phases

_STICKS: dict[tuple[int, Instrument], tuple[Phase, tuple[np.ndarray, np.ndarray]]] = {}
_STICKS_MAX = 4096


def sticks_of(phase: Phase, instrument: Instrument) -> tuple[np.ndarray, np.ndarray]:
    """``phase_sticks`` memoised per (phase object, instrument): phases from user CIFs need no id lookup."""
    key = (id(phase), instrument)
    hit = _STICKS.get(key)
    if hit is not None and hit[0] is phase:
        return hit[1]
    if len(_STICKS) >= _STICKS_MAX:
        _STICKS.clear()
    sticks = phase_sticks(phase, instrument)
    _STICKS[key] = (phase, sticks)  # holding the phase keeps its id from being reused
    return sticks


def zmv_weight_fractions(
    phases: list[Phase] | tuple[Phase, ...], scales: np.ndarray, lattice_scales: np.ndarray
) -> dict[str, float]:
    """w_p = S_p (ZM)_p V_p / Σ_q S_q (ZM)_q V_q with V_p = V₀ a_p³ (see the module docstring)."""
    mass = np.array(
        [s * p.cell_mass * p.volume * a**3 for p, s, a in zip(phases, scales, lattice_scales, strict=True)]
    )
    total = float(mass.sum())
    if total <= 0:
        return {p.id: 0.0 for p in phases}
    return {p.id: float(m / total) for p, m in zip(phases, mass, strict=True)}


def fraction_mae(claimed: dict[str, float], fitted: dict[str, float]) -> float | None:
    """Mean |w_claimed − w_fit| over the fitted phases, claimed fractions normalised to sum 1."""
    if not fitted or any(pid not in claimed or claimed[pid] is None for pid in fitted):
        return None
    total = sum(claimed[pid] for pid in fitted)
    if total <= 0:
        return None
    return float(np.mean([abs(claimed[pid] / total - w) for pid, w in fitted.items()]))


def significance_threshold(params_per_phase: int, dof: int, level: float) -> float:
    """F⁻¹_{k, ν}(1 − level): the F_p above which a phase's χ² rise is more than counting noise explains."""
    from scipy.stats import f as f_distribution

    return float(f_distribution.isf(level, params_per_phase, dof))


#: the largest lag-1 residual autocorrelation ``serial_inflation`` believes: c = (1 + ρ)/(1 − ρ) ≤ 4
MAX_SERIAL_RHO = 0.6


def serial_inflation(resid: np.ndarray, profile: np.ndarray) -> np.ndarray:
    """c_p = (1 + ρ_p) / (1 − ρ_p) ≥ 1, ρ_p the lag-1 autocorrelation of the residual weighted by ``profile``.

        ρ_p = Σ_i ½(P_p,i + P_p,i+1) r_i r_i+1 / Σ_i P_p,i r_i²,   clipped to [0, ``MAX_SERIAL_RHO``]

    For an AR(1) residual the variance of a sum over m points is m σ² (1 + ρ)/(1 − ρ) for
    large m, so a Δχ² built from correlated misfit carries c_p times fewer independent points
    (Bérar & Lelann 1991, J. Appl. Cryst. 24, 1). Counting noise alone gives ρ ≈ 0, c ≈ 1.
    The cap (c ≤ 4) is empirical: where the model is grossly wrong (a doublet fitted to a
    Kα1-only pattern) ρ reaches 0.8-0.9 under a real phase's own lines too, and an uncapped
    c dropped a 30 % NiO; with the cap, phases that only soak up profile misfit (F 5-15
    uncorrected) still fall below the critical F (docs/xrd-identify.md, foreign benchmark).
    """
    pair = 0.5 * (profile[:-1] + profile[1:])  # (n - 1, P)
    lagged = (resid[:-1] * resid[1:]) @ pair
    rho = np.clip(lagged / np.maximum(resid**2 @ profile, 1e-300), 0.0, MAX_SERIAL_RHO)
    return (1.0 + rho) / (1.0 - rho)


class _State:
    """The nonlinear parameters of one v1 fit."""

    def __init__(self, n_phase: int, size: float):
        self.zero = 0.0
        self.displacement = 0.0
        self.lattice = np.ones(n_phase)
        self.size = np.full(n_phase, size)
        self.strain = np.zeros(n_phase)
        self.b_iso = np.zeros(n_phase)


def fit_phases_v1(
    two_theta: np.ndarray,
    counts: np.ndarray,
    phases: list[Phase] | tuple[Phase, ...],
    instrument: Instrument,
    config: FitConfig,
    *,
    claimed_fractions: dict[str, float] | None = None,
) -> FitResult:
    """Fit ``phases`` to the counts; see the module docstring."""
    opts = config.v1
    grid = np.asarray(two_theta, dtype=float)
    basis = chebyshev_basis(instrument, config.background_degree, grid)
    problem = LinearProblem(np.asarray(counts, dtype=float), basis)
    phases = tuple(phases)
    ids = tuple(p.id for p in phases)
    if len(set(ids)) != len(ids):
        raise ValueError(f"phase ids must be distinct, got {ids}")
    n_phase = len(phases)
    sticks = [sticks_of(p, instrument) for p in phases]
    step = grid[1] - grid[0]
    theta = np.radians(grid / 2.0)
    dshift_dstrain = -np.degrees(2.0 * np.tan(theta))  # d(2θ)/dε_a for a lattice scale 1 + ε_a
    dshift_ddisp = -np.degrees(2.0 * np.cos(theta) / instrument.goniometer_radius_mm)  # d(2θ)/ds
    state = _State(n_phase, 100.0)
    refine_b = opts.refine_b_iso and opts.max_b_iso > 0
    if refine_b:
        state.b_iso[:] = min(opts.b_iso_start, opts.max_b_iso)
    # s² = (sin θ / λ₁)² of every Kα1 stick, for the Debye–Waller factor
    s2 = [(np.sin(np.radians(pos / 2.0)) / instrument.wavelength_ka1) ** 2 for pos, _ in sticks]

    def b_sticks(derivative: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
        """The sticks with I_k exp(−2 B_p s_k²) (or its B derivative when ``derivative``)."""
        out = []
        for (pos, inten), q, b in zip(sticks, s2, state.b_iso, strict=True):
            factor = np.exp(-2.0 * b * q)
            out.append((pos, inten * factor * (-2.0 * q if derivative else 1.0)))
        return out

    def render(size: np.ndarray, strain: np.ndarray, derivative: bool = False) -> list[np.ndarray]:
        inst = instrument.model_copy(
            update={
                "zero_shift": instrument.zero_shift + state.zero,
                "displacement_mm": instrument.displacement_mm + state.displacement,
            }
        )
        return render_phases(
            inst,
            b_sticks(derivative) if refine_b else sticks,
            state.lattice.tolist(),
            crystallite_nm=size.tolist(),
            grid=grid,
            microstrain=strain.tolist(),
        )

    def current_rwp() -> float:
        return problem.solve(problem.design(render(state.size, state.strain)))[0]

    def gauss_newton() -> None:
        """One linearised update of (zero, s, a_p), halved until Rwp does not rise (zero and s are
        nearly collinear over a short scan, so a full step can overshoot)."""
        cols = render(state.size, state.strain)
        design = problem.design(cols)
        rwp0, scales, _ = problem.solve(design)
        derivs = np.gradient(np.column_stack(cols), step, axis=0)  # (n, P)
        total = derivs @ scales
        extra = [-total]
        if opts.max_displacement_mm > 0:
            extra.append(-dshift_ddisp * total)
        if config.max_lattice_strain > 0:
            extra += list((-(dshift_dstrain[:, None] * derivs) * scales).T)
        if refine_b:
            extra += [col * s for col, s in zip(render(state.size, state.strain, True), scales, strict=True)]
        a = np.hstack([design, problem.design(extra)])
        coef = normal_lstsq(a.T @ a, a.T @ problem.y_perp, a, problem.y_perp)[n_phase:]
        start = (state.zero, state.displacement, state.lattice.copy(), state.b_iso.copy())
        live = scales > 0
        lo, hi = 1 - config.max_lattice_strain, 1 + config.max_lattice_strain
        for damping in (1.0, 0.5, 0.25, 0.1):
            state.zero = float(
                np.clip(start[0] + damping * coef[0], -config.max_zero_shift, config.max_zero_shift)
            )
            k = 1
            if opts.max_displacement_mm > 0:
                state.displacement = float(
                    np.clip(start[1] + damping * coef[1], -opts.max_displacement_mm, opts.max_displacement_mm)
                )
                k = 2
            if config.max_lattice_strain > 0:
                state.lattice = np.where(
                    live, np.clip(start[2] + damping * coef[k : k + n_phase], lo, hi), start[2]
                )
                k += n_phase
            if refine_b:
                state.b_iso = np.where(
                    live, np.clip(start[3] + damping * coef[k : k + n_phase], 0.0, opts.max_b_iso), start[3]
                )
            if current_rwp() <= rwp0:
                return
        state.zero, state.displacement, state.lattice, state.b_iso = start

    def scan(values: tuple[float, ...], which: str) -> None:
        """Coordinate descent of each phase's size or microstrain over ``values``."""
        if len(values) < 2:
            return
        columns = []  # per value: projected design (n, P) with every phase at that value
        for v in values:
            size = np.full(n_phase, v) if which == "size" else state.size
            strain = np.full(n_phase, v) if which == "strain" else state.strain
            columns.append(problem.design(render(size, strain)))
        stacked = np.stack(columns)  # (V, n, P)
        current = np.array(
            [int(np.argmin(np.abs(np.asarray(values) - getattr(state, which)[p]))) for p in range(n_phase)]
        )
        for _ in range(2):
            changed = False
            for p in range(n_phase):
                base = stacked[current, :, np.arange(n_phase)].T  # (n, P) the current choice per phase
                trials = np.repeat(base[None], len(values), axis=0)
                trials[:, :, p] = stacked[:, :, p]
                best = int(np.argmin(problem.rwps(trials)))
                changed |= best != current[p]
                current[p] = best
            if not changed:
                break
        getattr(state, which)[:] = np.asarray(values)[current]

    rwp_bg = problem.rwp(problem.y_perp)
    params_per_phase = 5 if refine_b else 4  # scale, lattice, size, strain (, B)
    n_params = params_per_phase * n_phase + 2 + config.background_degree + 1
    dof = max(len(grid) - n_params, 1)
    rexp = float(np.sqrt(dof / problem.norm))

    if n_phase:
        if config.max_zero_shift > 0:
            base = np.column_stack(render(state.size, state.strain))
            n_side = int(np.ceil(config.max_zero_shift / COARSE_ZERO_STEP))
            trials = np.linspace(-config.max_zero_shift, config.max_zero_shift, 2 * n_side + 1)
            shifted = problem.project(translated(base, trials, step) * problem.sw[:, None])
            state.zero = float(trials[int(np.argmin(problem.rwps(shifted)))])
        gauss_newton()
        gauss_newton()
        scan(opts.size_grid_nm, "size")
        scan(opts.microstrain_grid, "strain")
        gauss_newton()

    cols = render(state.size, state.strain) if n_phase else []
    design = problem.design(cols)
    rwp, scale_arr, resid = problem.solve(design)
    model = (problem.yw - resid) / problem.sw
    peaks = np.column_stack(cols) @ scale_arr if n_phase else np.zeros_like(grid)
    denom = rwp_bg**2 - rexp**2
    quality = float(np.clip(1.0 - (rwp**2 - rexp**2) / denom, 0.0, 1.0)) if denom > 0 else 0.0
    chi2 = problem.norm * rwp**2
    chi2_nu = max(chi2 / dof, 1e-12)
    significance: dict[str, float] = {}
    if n_phase:
        without = problem.rwps(np.stack([np.delete(design, i, axis=1) for i in range(n_phase)]))
        # reduced χ² where each phase has intensity: Σ_i P_p,i r_i² / Σ_i P_p,i (r the weighted
        # residual), at least the global one; a phase that only soaks up the misfit of another
        # phase's peaks sits where this is large
        profile = np.column_stack(cols)  # (n, P)
        gain = [problem.norm * r**2 - chi2 for r in without]
        region = profile  # (n, P) where each phase's Δχ² and misfit scale are measured
        if opts.unique_lines:
            # Δχ² counted only where p's fitted contribution exceeds all the other phases' together
            contrib = profile * scale_arr  # (n, P)
            unique = contrib > (contrib.sum(axis=1, keepdims=True) - contrib)
            for i in range(n_phase):
                resid_without = problem.solve(np.delete(design, i, axis=1))[2]
                gain[i] = min(gain[i], float((resid_without**2 - resid**2)[unique[:, i]].sum()))
            # the misfit scale over the same points: a minor phase's lines under a major phase's
            # misfit would otherwise borrow that phase's misfit as their own noise
            own = profile * unique
            region = np.where(own.sum(axis=0) > 0, own, profile)
        local = (resid**2 @ region) / np.maximum(region.sum(axis=0), 1e-300)  # (P,)
        # never below counting noise (1): so a significant phase always lowers χ² by more than k_p
        local = np.maximum(local * len(grid) / dof, max(chi2_nu, 1.0))
        if opts.serial_correlation:
            local = local * serial_inflation(resid, region)
        significance = {
            pid: float(g / params_per_phase / nu) for pid, g, nu in zip(ids, gain, local, strict=True)
        }
    critical = significance_threshold(params_per_phase, dof, opts.significance_level)
    superfluous = tuple(pid for pid in ids if denom <= 0 or significance[pid] <= critical)
    fractions = zmv_weight_fractions(phases, scale_arr, state.lattice)
    mae = fraction_mae(claimed_fractions, fractions) if claimed_fractions else None
    factor = 1.0
    if mae is not None:
        excess = (mae - opts.fraction_tolerance) / opts.fraction_scale
        factor = 1.0 - opts.fraction_weight * float(np.clip(excess, 0.0, 1.0))
    reward = max(0.0, quality * factor - config.penalty * len(superfluous))
    return FitResult(
        phase_ids=ids,
        rwp=rwp,
        rwp_background=rwp_bg,
        rexp=rexp,
        scales=dict(zip(ids, scale_arr.tolist(), strict=True)),
        weight_fractions=fractions,
        zero_shift=state.zero,
        lattice_scales=dict(zip(ids, state.lattice.tolist(), strict=True)),
        crystallite_nm=float(np.median(state.size)) if n_phase else float("nan"),
        superfluous=superfluous,
        quality=quality,
        reward=reward,
        profile=model,
        version="v1",
        crystallite_nm_by_phase=dict(zip(ids, state.size.tolist(), strict=True)),
        microstrain=dict(zip(ids, state.strain.tolist(), strict=True)),
        displacement_mm=state.displacement,
        significance=significance,
        fraction_mae=mae,
        background=model - peaks,
        b_iso=dict(zip(ids, state.b_iso.tolist(), strict=True)) if refine_b else {},
    )
