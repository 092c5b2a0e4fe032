"""Phase identification of a measured pattern: which phases, how much, how good is the fit.

``identify(pattern, wavelength=..., radiation=..., cifs=[...], library="default")`` runs three stages:

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
   The RL env's label-free verifier runs the same fit (``FitConfig(version="v1")``) with a
   quartic background (its patterns come from labrl's simulator); ``identify`` fits a measured
   pattern's background with degree ``MEASURED_BACKGROUND_DEGREE`` and inflates each phase's
   misfit scale by the residuals' serial correlation (``FitV1Options.serial_correlation``).

One answer per phase set: a fitted set is reduced to its phases that are significant
(``fit_v1``'s F-test) and above 0.0 % (``ZERO_FRACTION``), refitted until nothing more
drops, and each reduced set is ranked once.

The beam (``radiation.beam_hypotheses``): the file's Kα1, Kα2 and ratio where it states
them, else ``radiation`` (``"CuKa"``, ``"CuKa1"``, ...) or ``wavelength``. A wavelength equal
to an anode's Kα1 with nothing saying whether Kα2 is there gets both searches, with the
doublet (ratio 0.5) and with Kα1 alone; the top sets of both are fitted under both beams
and the beam with the lower Rwp is kept. Any other wavelength is one line (synchrotron).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from labrl.errors import ConfigError
from labrl.verifiers.xrd.anomalous import ANODE_LINES, line_for
from labrl.verifiers.xrd.fit import fit_phases
from labrl.verifiers.xrd.fit_config import FitConfig, FitResult, FitV1Options
from labrl.verifiers.xrd.fit_linear import LinearProblem
from labrl.verifiers.xrd.fit_v1 import sticks_of
from labrl.verifiers.xrd.library import Phase
from labrl.verifiers.xrd.profile import Instrument, chebyshev_basis, render_phases
from labrl.verifiers.xrd.radiation import Beam, beam_hypotheses, check_wavelength, parse_radiation
from labrl.verifiers.xrd.readers import MeasuredPattern, read_pattern

#: a fitted weight fraction below this is shown as 0.0 % and dropped from the set
ZERO_FRACTION = 5e-4


def instrument_for(
    pattern: MeasuredPattern, beam: Beam, *, monochromator_two_theta: float | None = None
) -> Instrument:
    """The nominal instrument of ``pattern`` with ``beam``: its scan range and step, the beam's lines.

    Anomalous dispersion (f′, f″) is on wherever the Kα1 wavelength is a tabulated anode line
    (``anomalous.line_for``), off otherwise (synchrotron energies are not tabulated);
    ``monochromator_two_theta`` sets the monochromator polarisation (None: none).
    """
    try:
        line_for(beam.ka1)
        anomalous = True
    except ConfigError:
        anomalous = False
    return Instrument(
        anomalous_dispersion=anomalous,
        monochromator_two_theta=monochromator_two_theta,
        two_theta_min=float(pattern.two_theta[0]),
        two_theta_max=float(pattern.two_theta[-1]),
        step=pattern.step,
        wavelength_ka1=beam.ka1,
        wavelength_ka2=beam.ka2,
        ka2_ratio=beam.ratio,
    )


def pattern_beams(pattern: MeasuredPattern, *, radiation: str | None = None, wavelength: float | None = None):
    """``radiation.beam_hypotheses`` for ``pattern``: what its file states, and what the user says."""
    stated = pattern.source.get("wavelength_from_file", True)
    return beam_hypotheses(
        pattern.wavelength if stated else None,
        pattern.wavelength_ka2,
        pattern.ka2_ratio,
        radiation=radiation,
        wavelength=wavelength,
        path=str(pattern.source.get("path", "pattern")),
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
    beam: Beam | None = None  # the beam of ``instrument`` (None: built without one)
    beam_source: str = ""  # what decided it (``radiation.BeamHypotheses.source``)
    beam_rwp: dict[str, float] = field(default_factory=dict)  # hypothesis label -> Rwp, when chosen by Rwp

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
                "beam": self.beam.label if self.beam else None,
                "source": self.beam_source,
                "hypotheses_rwp": {k: round(v, 5) for k, v in self.beam_rwp.items()},
            },
            "ranked": [r.to_dict() for r in self.ranked],
            "screened": [[pid, round(s, 5)] for pid, s in self.screened],
        }


#: Chebyshev degree of a measured pattern's background. The envs' quartic (``FitConfig``) fits
#: labrl's simulated backgrounds; a measured one also carries an amorphous or air-scatter hump a
#: few degrees wide, which a quartic over a 70° scan leaves in the residual, where a phase with
#: maximally broadened lines then soaks it up (foreign set: 10 of 16 misses were such extras).
#: Degree 8 follows features ~8° wide and still not a Bragg line (< 1°).
MEASURED_BACKGROUND_DEGREE = 8


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
        ambient: bool = True,
    ):
        if max_phases < 1 or n_screen < 1 or beam < 1 or n_fit < 1:
            raise ConfigError("max_phases, n_screen, beam and n_fit must be at least 1")
        self.max_phases = max_phases
        self.n_screen = n_screen
        self.beam = beam
        self.n_fit = n_fit
        self.n_extend = n_extend
        self.screen_crystallite_nm = screen_crystallite_nm
        # a measured profile is never exactly the model's: correlated misfit is not counting noise;
        # and its background is not a quartic (module docstring: MEASURED_BACKGROUND_DEGREE)
        self.fit = fit or FitConfig(
            version="v1",
            background_degree=MEASURED_BACKGROUND_DEGREE,
            v1=FitV1Options(serial_correlation=True),
        )
        self.monochromator_two_theta = monochromator_two_theta  # degrees; None: no monochromator
        self.ambient = ambient  # library candidates: only phases solid at room temperature (solid_at_ambient)


#: elements whose every compound made only of them is a gas at room temperature (N2, O2, NH3, ...)
AMBIENT_GASES = frozenset({"H", "N", "O", "F", "Cl", "He", "Ne", "Ar", "Kr", "Xe", "Rn"})
#: elements that are liquid at room temperature (their pure solid needs cooling)
AMBIENT_LIQUIDS = frozenset({"Hg", "Br"})


def solid_at_ambient(phase: Phase) -> bool:
    """False for a library phase that exists only cold: a solid made only of gas-forming elements
    (α-O2, γ-N2, solid NH3, Ne; the library holds no ionic solid of them alone, such as NH4Cl:
    tests/xrd/test_xrd_identify.py lists what this rule drops) or a pure liquid element (Hg).
    A sample measured at room temperature cannot hold them, yet their few strong lines can soak
    up the misfit of a profile the fit does not model."""
    elements = set(phase.elements)
    return not (elements <= AMBIENT_GASES or (len(elements) == 1 and elements <= AMBIENT_LIQUIDS))


#: ``library`` values of ``identify``: "v1" (the default) is the v1 library's experimental entries
LIBRARY_CHOICES = ("v1", "v1-all", "v0", "none")


def candidate_phases(
    cifs: Sequence[str | Path] = (),
    library: str | None = "v1",
    elements: Sequence[str] | None = None,
    ambient: bool = True,
) -> tuple[list[Phase], int]:
    """(candidates, how many of them the CIFs gave): the CIF phases first, then the library's.

    ``ambient``: library phases only where ``solid_at_ambient`` (a CIF is always a candidate).

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
        if ambient:
            pool = [p for p in pool if solid_at_ambient(p)]
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
    radiation: str | None = None,
    cifs: Sequence[str | Path] = (),
    library: str | None = "v1",
    elements: Sequence[str] | None = None,
    top: int = 5,
    options: IdentifyOptions | None = None,
) -> IdentifyResult:
    """Rank phase sets for ``pattern`` (a ``MeasuredPattern`` or a file path); see the module docstring.

    ``radiation``: the tube's lines (``radiation.RADIATIONS``: ``"CuKa"`` the Kα1/Kα2 doublet,
    ``"CuKa1"`` Kα1 alone, ...); ``wavelength`` (Å) without it: that line, or both hypotheses
    when it is an anode's Kα1. A file's own wavelengths keep priority.
    """
    options = options or IdentifyOptions()
    if wavelength is not None:
        check_wavelength(wavelength)
    if not isinstance(pattern, MeasuredPattern):
        # the radiation's Kα1 converts a Q or d column when no wavelength is given
        named = ANODE_LINES[parse_radiation(radiation)[0]][0] if radiation is not None else None
        pattern = read_pattern(pattern, wavelength=wavelength if wavelength is not None else named)
    pattern = pattern.uniform()
    if len(pattern.two_theta) < 20:
        raise ConfigError(
            f"{pattern.source.get('path', 'pattern')}: {len(pattern.two_theta)} points; need 20"
        )
    hypotheses = pattern_beams(pattern, radiation=radiation, wavelength=wavelength)
    phases, n_cif = candidate_phases(cifs, library, elements, ambient=options.ambient)
    searches = [
        _Search(
            pattern,
            instrument_for(pattern, b, monochromator_two_theta=options.monochromator_two_theta),
            phases,
            n_cif,
            options,
        )
        for b in hypotheses.beams
    ]
    leaders = {search.ranked()[0].key for search in searches}
    # each beam's Rwp on the best sets of both: the same phases, only the lines differ
    beam_rwp = [min(search.fit(s).rwp for s in leaders) for search in searches]
    chosen = int(np.argmin(beam_rwp))
    search = searches[chosen]
    return IdentifyResult(
        pattern=pattern,
        instrument=search.instrument,
        ranked=tuple(r.result for r in search.ranked()[:top]),
        screened=search.screened,
        beam=hypotheses.beams[chosen],
        beam_source=hypotheses.source,
        beam_rwp=(
            {b.label: r for b, r in zip(hypotheses.beams, beam_rwp, strict=True)} if len(searches) > 1 else {}
        ),
    )


@dataclass(frozen=True)
class _Ranked:
    key: tuple[int, ...]  # the set's phases (indices into the candidates), all significant
    result: PhaseSetResult


class _Search:
    """Screening, set search and fits of the candidates under one instrument (module docstring)."""

    def __init__(
        self,
        pattern: MeasuredPattern,
        instrument: Instrument,
        phases: list[Phase],
        n_cif: int,
        options: IdentifyOptions,
    ):
        self.grid, self.counts = pattern.two_theta, pattern.intensity
        self.instrument, self.phases, self.options = instrument, phases, options
        self.fitted: dict[tuple[int, ...], PhaseSetResult] = {}
        problem = LinearProblem(
            self.counts, chebyshev_basis(instrument, options.fit.background_degree, self.grid)
        )
        scores, design = _screen(problem, self.grid, instrument, phases, options.screen_crystallite_nm)
        order = [int(i) for i in np.argsort(-scores, kind="stable")]
        self.screened = tuple((phases[i].id, float(scores[i])) for i in order[: max(options.n_screen, n_cif)])
        pool = [*range(n_cif), *(i for i in order[: options.n_screen] if i >= n_cif)]  # best first
        sets = _beam_search(problem, design, pool, options.max_phases, options.beam)
        # the best few sets of each size go to the full fit
        per_size: dict[int, list[tuple[int, ...]]] = {}
        for s in sets:
            per_size.setdefault(len(s), []).append(s)
        budget = max(1, options.n_fit // max(len(per_size), 1))
        for size_sets in per_size.values():
            for s in size_sets[:budget]:
                self.fit(s)
        # the broadened columns of the search can prefer a near-twin of the right phase, so the best
        # fitted set is also tried with each screened phase added (fitted, not broadened)
        best = min(self.fitted, key=lambda s: (-self.fitted[s].reward, self.fitted[s].rwp))
        if len(best) < options.max_phases:
            for j in pool[: options.n_extend]:
                if j not in best:
                    self.fit(tuple(sorted((*best, j))))
        self._ranked: list[_Ranked] | None = None

    def fit(self, phase_set: tuple[int, ...]) -> PhaseSetResult:
        if phase_set not in self.fitted:
            self.fitted[phase_set] = _fit_set(
                self.grid, self.counts, [self.phases[i] for i in phase_set], self.instrument, self.options.fit
            )
        return self.fitted[phase_set]

    def significant(self, phase_set: tuple[int, ...]) -> tuple[int, ...]:
        """``phase_set`` without its phases at 0.0 % or not significant, refitted until none drops."""
        while True:
            result = self.fit(phase_set)
            kept = tuple(
                i
                for i in phase_set
                if self.phases[i].id not in result.superfluous
                and result.fit.weight_fractions[self.phases[i].id] >= ZERO_FRACTION
            )
            if not kept or kept == phase_set:
                return phase_set
            phase_set = kept

    def ranked(self) -> list[_Ranked]:
        """One entry per reduced phase set, by reward, ties by Rwp."""
        if self._ranked is None:
            keys = {self.significant(s) for s in list(self.fitted)}
            entries = [_Ranked(k, self.fit(k)) for k in keys]
            self._ranked = sorted(entries, key=lambda e: (-e.result.reward, e.result.rwp, e.key))
        return self._ranked


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
