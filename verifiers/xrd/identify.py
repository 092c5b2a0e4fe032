"""Phase identification of a measured pattern: which phases, how much, how good is the fit.

``identify(pattern, wavelength=..., cifs=[...], library="default")`` runs three stages:

1. **Screening.** Every candidate (the user's CIFs and the library's phases, optionally
   only those made of ``elements``) is rendered once with broadened peaks
   (``screen_crystallite_nm``, so small lattice and zero-shift mismatches still overlap)
   and scored by the share of the background-subtracted weighted signal it explains
   alone: s_p = (x_pᵀ y⊥)² / (x_pᵀ x_p · Σ w y²) for a positive scale, 0 otherwise
   (x_p, y⊥ weighted and projected off the Chebyshev background as in ``fit``).
   The ``n_screen`` best (and every CIF phase) go on.
2. **Set search.** A beam search (width ``beam``) grows phase sets one phase at a time up
   to ``max_phases``, ranking sets by the Rwp of the linear non-negative fit of the same
   broadened columns.
3. **Fit.** The best sets of every size are refined with the v1 fit (``fit_v1``: per-phase
   scale, lattice, crystallite size and microstrain, zero shift, background) and ranked by
   its label-free reward (Rwp improvement, significance of every phase), ties by Rwp.
   The best fitted set is then also fitted with each of the ``n_extend`` best screened
   phases added (the broadened search columns can prefer a near-twin of the right phase),
   and everything is ranked again.
   The RL env's label-free verifier runs the same fit (``FitConfig(version="v1")``).

Wavelength: the file's Kα1 (and Kα2, ratio) where it states them, else ``wavelength``;
a wavelength equal (±0.002 Å) to a common anode's Kα1 or its weighted mean
(2 Kα1 + Kα2)/3 takes that anode's Kα1/Kα2 doublet with ratio 0.5; any other is
treated as monochromatic (synchrotron).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from labrl.errors import ConfigError
from labrl.verifiers.xrd.anomalous import line_for
from labrl.verifiers.xrd.fit import fit_phases
from labrl.verifiers.xrd.fit_config import FitConfig, FitResult
from labrl.verifiers.xrd.fit_linear import LinearProblem
from labrl.verifiers.xrd.fit_v1 import sticks_of
from labrl.verifiers.xrd.library import Phase
from labrl.verifiers.xrd.profile import Instrument, chebyshev_basis, render_phases
from labrl.verifiers.xrd.readers import MeasuredPattern, read_pattern
from labrl.verifiers.xrd.scattering import CU_KA1, CU_KA2

# Kα1, Kα2 in Å (Bearden 1967, as tabulated in International Tables for Crystallography Vol. C,
# Table 4.2.2.1); Cu as used by the simulator
ANODES: dict[str, tuple[float, float]] = {
    "Cr": (2.28970, 2.29361),
    "Fe": (1.93604, 1.93998),
    "Co": (1.78897, 1.79285),
    "Cu": (CU_KA1, CU_KA2),
    "Mo": (0.709300, 0.713590),
    "Ag": (0.559407, 0.563798),
}
_ANODE_TOL = 0.002  # Å


def instrument_for(
    pattern: MeasuredPattern,
    wavelength: float | None = None,
    *,
    monochromator_two_theta: float | None = None,
) -> Instrument:
    """The nominal instrument of ``pattern``: its scan range and step, its wavelengths (module docstring).

    Anomalous dispersion (f′, f″) is on wherever the Kα1 wavelength is a tabulated anode line
    (``anomalous.line_for``), off otherwise (synchrotron energies are not tabulated);
    ``monochromator_two_theta`` sets the monochromator polarisation (None: none).
    """
    lam = pattern.wavelength if pattern.wavelength is not None else wavelength
    if lam is None:
        raise ConfigError(
            f"{pattern.source.get('path', 'pattern')}: the file states no wavelength; give --wavelength (Å)"
        )
    ka2, ratio = pattern.wavelength_ka2, pattern.ka2_ratio
    if ka2 is None:
        for ka1_anode, ka2_anode in ANODES.values():
            mean = (2 * ka1_anode + ka2_anode) / 3
            if abs(lam - ka1_anode) < _ANODE_TOL or abs(lam - mean) < _ANODE_TOL:
                lam, ka2, ratio = ka1_anode, ka2_anode, 0.5 if ratio is None else ratio
                break
    if ka2 is None:
        ka2, ratio = lam, 0.0
    try:
        line_for(float(lam))
        anomalous = True
    except ConfigError:
        anomalous = False
    return Instrument(
        anomalous_dispersion=anomalous,
        monochromator_two_theta=monochromator_two_theta,
        two_theta_min=float(pattern.two_theta[0]),
        two_theta_max=float(pattern.two_theta[-1]),
        step=pattern.step,
        wavelength_ka1=float(lam),
        wavelength_ka2=float(ka2),
        ka2_ratio=float(ratio or 0.0),
    )


@dataclass(frozen=True)
class PhaseReport:
    id: str
    formula: str
    space_group: str
    source: str
    weight_fraction: float
    abc: tuple[float, float, float]  # refined, Å
    lattice_scale: float
    crystallite_nm: float
    microstrain: float
    significance: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "formula": self.formula,
            "space_group": self.space_group,
            "source": self.source,
            "weight_fraction": round(self.weight_fraction, 4),
            "abc": [round(x, 5) for x in self.abc],
            "lattice_scale": round(self.lattice_scale, 6),
            "crystallite_nm": round(self.crystallite_nm, 1),
            "microstrain": self.microstrain,
            "significance": round(self.significance, 1),
        }


@dataclass(frozen=True)
class PhaseSetResult:
    phases: tuple[PhaseReport, ...]
    rwp: float
    rexp: float
    quality: float
    reward: float
    superfluous: tuple[str, ...]
    fit: FitResult = field(repr=False)
    structures: tuple[Phase, ...] = field(repr=False, default=())  # the phases, in ``phases`` order

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(p.id for p in self.phases)

    def to_dict(self) -> dict[str, Any]:
        return {
            "phases": [p.to_dict() for p in self.phases],
            "rwp": round(self.rwp, 5),
            "rexp": round(self.rexp, 5),
            "quality": round(self.quality, 4),
            "reward": round(self.reward, 4),
            "superfluous": list(self.superfluous),
            "zero_shift": round(self.fit.zero_shift, 4),
        }


@dataclass(frozen=True)
class IdentifyResult:
    pattern: MeasuredPattern
    instrument: Instrument
    ranked: tuple[PhaseSetResult, ...]
    screened: tuple[tuple[str, float], ...]  # (phase id, screening score), best first

    @property
    def best(self) -> PhaseSetResult:
        return self.ranked[0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "pattern": {
                **{k: v for k, v in self.pattern.source.items() if k != "header"},
                "points": len(self.pattern.two_theta),
                "two_theta_range": [float(self.pattern.two_theta[0]), float(self.pattern.two_theta[-1])],
            },
            "wavelength": {
                "ka1": self.instrument.wavelength_ka1,
                "ka2": self.instrument.wavelength_ka2,
                "ka2_ratio": self.instrument.ka2_ratio,
            },
            "ranked": [r.to_dict() for r in self.ranked],
            "screened": [[pid, round(s, 5)] for pid, s in self.screened],
        }


class IdentifyOptions:
    """Search settings (plain keyword arguments of ``identify``)."""

    def __init__(
        self,
        *,
        max_phases: int = 3,
        n_screen: int = 12,
        beam: int = 4,
        n_fit: int = 8,
        n_extend: int = 6,
        screen_crystallite_nm: float = 25.0,
        fit: FitConfig | None = None,
        monochromator_two_theta: float | None = None,
    ):
        if max_phases < 1 or n_screen < 1 or beam < 1 or n_fit < 1:
            raise ConfigError("max_phases, n_screen, beam and n_fit must be at least 1")
        self.max_phases = max_phases
        self.n_screen = n_screen
        self.beam = beam
        self.n_fit = n_fit
        self.n_extend = n_extend
        self.screen_crystallite_nm = screen_crystallite_nm
        self.fit = fit or FitConfig(version="v1")
        self.monochromator_two_theta = monochromator_two_theta  # degrees; None: no monochromator


#: ``library`` values of ``identify``: "v1" (the default) is the v1 library's experimental entries
LIBRARY_CHOICES = ("v1", "v1-all", "v0", "none")


def candidate_phases(
    cifs: Sequence[str | Path] = (),
    library: str | None = "v1",
    elements: Sequence[str] | None = None,
) -> tuple[list[Phase], int]:
    """(candidates, how many of them the CIFs gave): the CIF phases first, then the library's.

    ``library``: ``"v1"`` the experimental entries of the v1 library (no hypothetical
    substitutions: a measured sample holds real compounds), ``"v1-all"`` all v1 entries,
    ``"v0"`` the frozen v0 library, ``"none"`` (or None) only the CIFs; ``"default"`` is ``"v1"``.
    CIFs are read, validated and deduplicated by ``library.load_library``'s rules: a CIF whose
    structure matches a library phase (``StructureMatcher``) is that phase.
    """
    from labrl.verifiers.xrd.library import PhaseLibrary, cif_paths, cif_phases, load_library

    choice = "v1" if library == "default" else ("none" if library is None else library)
    if choice not in LIBRARY_CHOICES:
        raise ConfigError(f"unknown library {library!r}: use one of {', '.join(LIBRARY_CHOICES)}")
    base = PhaseLibrary([]) if choice == "none" else load_library("v0" if choice == "v0" else "v1")
    user: list[Phase] = []
    if cifs:
        _, user = cif_phases(base, cif_paths(cifs))
    pool: list[Phase] = []
    if choice != "none":
        pool = base.search(list(elements)) if elements else list(base)
        if choice == "v1":
            pool = [p for p in pool if p.experimental]
    phases: list[Phase] = []
    seen: set[str] = set()
    for p in [*user, *pool]:  # a CIF matching a library phase (or another CIF) is listed once
        if p.id not in seen:
            seen.add(p.id)
            phases.append(p)
    if not phases:
        raise ConfigError("no candidate phases: give --cif files or a library")
    return phases, len({p.id for p in user})


def _screen(
    problem: LinearProblem, grid: np.ndarray, instrument: Instrument, phases: list[Phase], size: float
) -> tuple[np.ndarray, np.ndarray]:
    """(scores (N,), weighted projected broadened columns (n, N)) of every candidate alone."""
    sticks = [sticks_of(p, instrument) for p in phases]
    columns = render_phases(instrument, sticks, [1.0] * len(phases), crystallite_nm=size, grid=grid)
    design = problem.design(columns)  # (n, N)
    dot = design.T @ problem.y_perp  # (N,)
    norm2 = np.einsum("ij,ij->j", design, design)
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.where((norm2 > 0) & (dot > 0), dot**2 / norm2 / problem.norm, 0.0)
    return score, design


def _beam_search(
    problem: LinearProblem, design: np.ndarray, pool: list[int], max_phases: int, beam: int
) -> list[tuple[int, ...]]:
    """Phase sets (indices into the design's columns) kept by the beam at every size, best first per size."""
    frontier: list[tuple[int, ...]] = [()]
    kept: list[tuple[int, ...]] = []
    for _ in range(max_phases):
        trials = sorted({tuple(sorted((*s, j))) for s in frontier for j in pool if j not in s})
        if not trials:
            break
        rwps = problem.rwps(np.stack([design[:, list(t)] for t in trials]))
        order = np.argsort(rwps, kind="stable")[:beam]
        frontier = [trials[i] for i in order]
        kept += frontier
    return kept


def identify(
    pattern: MeasuredPattern | str | Path,
    *,
    wavelength: float | None = None,
    cifs: Sequence[str | Path] = (),
    library: str | None = "v1",
    elements: Sequence[str] | None = None,
    top: int = 5,
    options: IdentifyOptions | None = None,
) -> IdentifyResult:
    """Rank phase sets for ``pattern`` (a ``MeasuredPattern`` or a file path); see the module docstring."""
    options = options or IdentifyOptions()
    if not isinstance(pattern, MeasuredPattern):
        pattern = read_pattern(pattern, wavelength=wavelength)
    pattern = pattern.uniform()
    if len(pattern.two_theta) < 20:
        raise ConfigError(
            f"{pattern.source.get('path', 'pattern')}: {len(pattern.two_theta)} points; need 20"
        )
    instrument = instrument_for(pattern, wavelength, monochromator_two_theta=options.monochromator_two_theta)
    phases, n_cif = candidate_phases(cifs, library, elements)
    grid = pattern.two_theta
    counts = pattern.intensity
    problem = LinearProblem(counts, chebyshev_basis(instrument, options.fit.background_degree, grid))
    scores, design = _screen(problem, grid, instrument, phases, options.screen_crystallite_nm)
    order = [int(i) for i in np.argsort(-scores, kind="stable")]
    pool = [*range(n_cif), *(i for i in order[: options.n_screen] if i >= n_cif)]  # best first
    sets = _beam_search(problem, design, pool, options.max_phases, options.beam)
    # the best few sets of each size go to the full fit
    per_size: dict[int, list[tuple[int, ...]]] = {}
    for s in sets:
        per_size.setdefault(len(s), []).append(s)
    budget = max(1, options.n_fit // max(len(per_size), 1))
    finalists = [s for size_sets in per_size.values() for s in size_sets[:budget]]
    fitted = {s: _fit_set(grid, counts, [phases[i] for i in s], instrument, options.fit) for s in finalists}
    # the broadened columns of the search can prefer a near-twin of the right phase, so the best
    # fitted set is also tried with each screened phase added (fitted, not broadened)
    best = min(fitted, key=lambda s: (-fitted[s].reward, fitted[s].rwp))
    if len(best) < options.max_phases:
        for j in pool[: options.n_extend]:
            grown = tuple(sorted((*best, j)))
            if j not in best and grown not in fitted:
                fitted[grown] = _fit_set(grid, counts, [phases[i] for i in grown], instrument, options.fit)
    results = sorted(fitted.values(), key=lambda r: (-r.reward, r.rwp))
    screened = tuple((phases[i].id, float(scores[i])) for i in order[: max(options.n_screen, n_cif)])
    return IdentifyResult(
        pattern=pattern, instrument=instrument, ranked=tuple(results[:top]), screened=screened
    )


def _fit_set(
    grid: np.ndarray, counts: np.ndarray, phases: list[Phase], instrument: Instrument, config: FitConfig
) -> PhaseSetResult:
    fit = fit_phases(grid, counts, phases, instrument, config)
    ordered = sorted(phases, key=lambda p: -fit.weight_fractions[p.id])
    reports = tuple(
        PhaseReport(
            id=p.id,
            formula=p.formula,
            space_group=f"{p.spacegroup_symbol} ({p.spacegroup_number})",
            source=p.source,
            weight_fraction=fit.weight_fractions[p.id],
            abc=tuple(x * fit.lattice_scales[p.id] for x in p.abc),  # type: ignore[arg-type]
            lattice_scale=fit.lattice_scales[p.id],
            crystallite_nm=fit.crystallite_nm_by_phase.get(p.id, fit.crystallite_nm),
            microstrain=fit.microstrain.get(p.id, 0.0),
            significance=fit.significance.get(p.id, float("nan")),
        )
        for p in ordered
    )
    return PhaseSetResult(
        phases=reports,
        rwp=fit.rwp,
        rexp=fit.rexp,
        quality=fit.quality,
        reward=fit.reward,
        superfluous=fit.superfluous,
        fit=fit,
        structures=tuple(ordered),
    )


def plot_fit(result: IdentifyResult, path: str | Path, rank: int = 0) -> Path:
    """PNG of observed vs fitted counts of ``result.ranked[rank]``, its background, the difference
    curve (observed − fitted, offset below) and tick marks at each phase's Kα1 positions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = result.ranked[rank]
    x, y, fit = result.pattern.two_theta, result.pattern.intensity, chosen.fit
    diff = y - fit.profile
    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=110)
    ax.plot(x, y, ".", ms=2, color="0.2", label="observed")
    ax.plot(x, fit.profile, "-", lw=0.9, color="tab:red", label="fitted")
    if fit.background is not None:
        ax.plot(x, fit.background, "-", lw=0.7, color="tab:green", label="background")
    offset = float(min(y.min(), fit.profile.min())) - 0.05 * float(np.ptp(y)) - float(diff.max())
    ax.plot(x, diff + offset, "-", lw=0.7, color="tab:blue", label="difference")
    span = 0.04 * float(np.ptp(y))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (report, phase) in enumerate(zip(chosen.phases, chosen.structures, strict=True)):
        ticks = fit_ticks(fit, phase, result.instrument)
        base = offset - (k + 1.5) * span
        ax.vlines(
            ticks,
            base,
            base + 0.8 * span,
            color=colors[(1, 4, 5, 6, 7, 8, 9)[k % 7]],
            lw=0.8,
            label=f"{phase.formula} {report.weight_fraction:.1%}",
        )
    ax.set_xlabel("2θ (degrees)")
    ax.set_ylabel("counts")
    ax.set_title(f"Rwp {chosen.rwp:.4f}   Rexp {chosen.rexp:.4f}   reward {chosen.reward:.3f}")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def fit_ticks(fit: FitResult, phase: Phase, instrument: Instrument) -> np.ndarray:
    """Kα1 peak positions of a fitted phase (refined lattice and zero shift) inside the scan."""
    pos, _ = sticks_of(phase, instrument)
    sin = np.sin(np.radians(pos / 2.0)) / fit.lattice_scales[phase.id]
    two_theta = np.degrees(2.0 * np.arcsin(sin[sin < 1.0])) + fit.zero_shift
    return two_theta[(two_theta >= instrument.two_theta_min) & (two_theta <= instrument.two_theta_max)]
