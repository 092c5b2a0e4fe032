"""XRD task generation: which sample is measured, how, and what the model is told.

A task is drawn from ``numpy.random.default_rng([split_code, seed, salt])``:
train and test use different ``split_code``, so their streams (and tasks) are
disjoint by construction, and every (split, seed) gives the same task.

Tiers (``PhaseIdConfig.tier``):

1. one phase; the prompt lists ``n_candidates`` candidates (A, B, ...) that
   share elements with the answer where the library allows; a clean, fixed
   instrument. Answer: the letter (or, with ``answer_format="formula"``,
   the candidate's formula; its space group too only where the formula
   alone would be ambiguous, see ``candidate_answer``).
2. one phase; only the elements are given; instrument zero shift, sample
   displacement and crystallite size vary. Answer: formula (+ space group).
3. two or three phases from related chemistry with weight fractions ≥ 0.1;
   also lattice strain, mild preferred orientation, lower counts. Answer:
   phases with weight fractions.

With ``holdout_fraction`` > 0 a fixed, hash-chosen subset of phases never
appears in train tasks, and every test task contains one of them.

Versions: ``library`` picks the phase library (``v0`` frozen, ``v1`` the
cited common phases and ``formula_sg_pearson`` ids), ``answer_pool`` whether
answers may be hypothetical phases, and ``physics`` the measurement model:
``v0`` as before; ``v1`` adds anomalous dispersion at Cu Kα1, a graphite
(002) diffracted-beam monochromator (``MONOCHROMATOR_TWO_THETA``) and per
phase an isotropic Debye–Waller B drawn from U(0.2, 1.0) Å². The
``xrd/*-v1`` envs default to v1 for all three; the v0 envs to v0.
"""

from __future__ import annotations

import hashlib
import math
import string
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from labrl.envs.types import Split
from labrl.errors import ConfigError
from labrl.verifiers.xrd.fit_config import FitConfig
from labrl.verifiers.xrd.library import LibraryVersion, Phase, PhaseLibrary, is_held_out, load_library
from labrl.verifiers.xrd.mixture import Component, Sample
from labrl.verifiers.xrd.profile import Instrument, PreferredOrientation

_SALT = 0x58524431  # "XRD1"
RewardMode = Literal["label", "label_free", "blend"]
AnswerFormat = Literal["letter", "formula"]
#: graphite (002), d = 3.354 Å, at Cu Kα1: 2θ_m = 2 asin(λ / 2d) ≈ 26.55°
MONOCHROMATOR_TWO_THETA = round(2.0 * math.degrees(math.asin(1.54056 / (2.0 * 3.354))), 3)
B_ISO_RANGE = (0.2, 1.0)  # Å², room-temperature isotropic B of common inorganic solids


class PhaseIdConfig(BaseModel):
    """Options of the xrd envs (pass them to ``labrl.envs.make``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tier: Literal[1, 2, 3] = 1
    n_peaks: int = Field(default=6, ge=1, le=40, description="peaks listed in the prompt")
    n_candidates: int = Field(default=4, ge=2, le=8, description="tier 1: candidate phases listed")
    answer_format: AnswerFormat = Field(
        default="letter",
        description="tier 1: ask for the candidate's letter, or for its formula (identify the phase "
        "directly instead of looking up which letter holds it; gold and random actions follow)",
    )
    show_widths: bool = Field(default=False, description="list peak FWHM next to 2θ and intensity")
    profile_points: int = Field(default=0, ge=0, le=400, description="append a downsampled profile (0 = off)")
    reward_mode: RewardMode = "label"
    blend_weight: float = Field(
        default=0.5, ge=0.0, le=1.0, description="weight of the label-free reward in blend"
    )
    holdout_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    phase_pool: int | None = Field(
        default=None,
        ge=2,
        description="draw tasks from a fixed subset of this many phases (hash order); None = the whole library. "
        "A small pool (e.g. 16) is a curriculum a tiny from-scratch model can learn in minutes.",
    )
    instrument_latency_s: float = Field(
        default=0.0, ge=0.0, description="simulated measurement time per reset"
    )
    fit_latency_s: float = Field(default=0.0, ge=0.0, description="simulated refinement time per fit")
    offload: bool = Field(default=True, description="simulate and fit in the process pool (run_cpu)")
    max_tool_calls: int = Field(default=8, ge=1, le=64, description="tools env: tool calls per episode")
    fit: FitConfig = Field(default_factory=FitConfig)
    library: LibraryVersion = Field(default="v0", description="phase library: v0 (frozen) or v1")
    answer_pool: Literal["all", "experimental"] = Field(
        default="all", description="experimental: answers are drawn from experimental structures only"
    )
    physics: Literal["v0", "v1"] = Field(
        default="v0",
        description="v1: anomalous dispersion, monochromator polarisation, per-phase Debye–Waller B",
    )

    @model_validator(mode="after")
    def _check(self) -> PhaseIdConfig:
        if self.tier == 1 and self.n_candidates > len(string.ascii_uppercase):
            raise ValueError("n_candidates too large")
        return self


def _split_code(split: Split) -> int:
    if split not in ("train", "test"):
        raise ConfigError(f"split must be 'train' or 'test', got {split!r}")
    return 0 if split == "train" else 1


def _restricted(library: PhaseLibrary, phase_pool: int | None) -> list[Phase]:
    """The first ``phase_pool`` phases in sha256(id) order: a fixed subset independent of library order."""
    phases = list(library)
    if phase_pool is None:
        return phases
    if phase_pool > len(phases):
        raise ConfigError(f"phase_pool={phase_pool} exceeds the library's {len(phases)} phases")
    return sorted(phases, key=lambda p: hashlib.sha256(p.id.encode()).hexdigest())[:phase_pool]


def _pools(library: list[Phase], holdout: float, split: Split) -> tuple[list[Phase], list[Phase]]:
    """(phases allowed in this split, phases the first component must come from)."""
    if holdout <= 0:
        return list(library), list(library)
    held = [p for p in library if is_held_out(p.id, holdout)]
    kept = [p for p in library if not is_held_out(p.id, holdout)]
    if not held or not kept:
        raise ConfigError(f"holdout_fraction={holdout} leaves an empty train or test pool")
    return (kept, kept) if split == "train" else (list(library), held)


def _related(
    rng: np.random.Generator, first: Phase, pool: list[Phase], exclude: set[str], n: int
) -> list[Phase]:
    """``n`` distinct phases, preferring those sharing an element with ``first``."""
    share = [p for p in pool if p.id not in exclude and set(p.elements) & set(first.elements)]
    other = [p for p in pool if p.id not in exclude and not set(p.elements) & set(first.elements)]
    chosen: list[Phase] = []
    for group in (share, other):
        if len(chosen) >= n:
            break
        picks = rng.permutation(len(group))[: n - len(chosen)]
        chosen += [group[i] for i in picks]
    return chosen


def _instrument(rng: np.random.Generator, tier: int) -> Instrument:
    if tier == 1:
        return Instrument()
    return Instrument(
        zero_shift=float(rng.uniform(-0.06, 0.06)),
        displacement_mm=float(rng.uniform(-0.1, 0.1)) if tier >= 2 else 0.0,
        caglioti_w=float(rng.uniform(0.0015, 0.003)),
    )


def build_task_prompt(
    config: PhaseIdConfig, split: Split, seed: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prompt data, answer) of task (split, seed). Pure: no simulation happens here."""
    library = load_library(config.library)
    rng = np.random.default_rng([_split_code(split), int(seed), _SALT])
    allowed, first_pool = _pools(_restricted(library, config.phase_pool), config.holdout_fraction, split)
    answerable = allowed
    if config.answer_pool == "experimental":
        first_pool = [p for p in first_pool if p.experimental]
        answerable = [p for p in allowed if p.experimental]
        if not first_pool:
            raise ConfigError("answer_pool='experimental' leaves no phase to draw answers from")
    first = first_pool[int(rng.integers(len(first_pool)))]
    tier = config.tier
    if tier == 3:
        n = int(rng.integers(2, 4))
        phases = [first, *_related(rng, first, answerable, {first.id}, n - 1)]
        raw = rng.dirichlet(np.full(n, 2.0))
        fractions = 0.1 + (1.0 - 0.1 * n) * raw
        fractions = np.round(fractions / fractions.sum(), 4)
        fractions[-1] = round(1.0 - float(fractions[:-1].sum()), 4)
    else:
        phases, fractions = [first], np.array([1.0])
    components = []
    for phase, w in zip(phases, fractions, strict=True):
        size = 100.0 if tier == 1 else float(np.exp(rng.uniform(np.log(40.0), np.log(300.0))))
        strain = 1.0 if tier < 3 else float(1.0 + rng.uniform(-0.002, 0.002))
        orientation = None
        if tier == 3 and rng.random() < 0.3:
            hkl = [(0, 0, 1), (1, 0, 0), (1, 1, 0), (1, 1, 1)][int(rng.integers(4))]
            orientation = PreferredOrientation(hkl=hkl, r=float(rng.uniform(0.8, 1.2)))
        components.append(
            Component(
                phase_id=phase.id,
                weight_fraction=float(w),
                crystallite_nm=size,
                lattice_scale=strain,
                orientation=orientation,
            )
        )
    instrument = _instrument(rng, tier)
    if config.physics == "v1":
        instrument = Instrument.model_validate(
            {
                **instrument.model_dump(),
                "anomalous_dispersion": True,
                "monochromator_two_theta": MONOCHROMATOR_TWO_THETA,
            }
        )
        components = [
            c.model_copy(update={"b_iso": round(float(rng.uniform(*B_ISO_RANGE)), 3)}) for c in components
        ]
    sample = Sample(
        components=tuple(components),
        instrument=instrument,
        background=(float(rng.uniform(100, 400)), float(rng.uniform(-80, 0)), float(rng.uniform(0, 40))),
        peak_counts=20_000.0 if tier == 1 else float(rng.uniform(5_000, 20_000)),
    )
    prompt: dict[str, Any] = {
        "tier": tier,
        "sample": sample.model_dump(mode="json"),
        "noise_seed": int(rng.integers(2**31)),
        "elements": sorted({el for p in phases for el in p.elements}),
    }
    if tier == 1:
        distractors = _related(rng, first, allowed, {first.id}, config.n_candidates - 1)
        options = [first, *distractors]
        order = rng.permutation(len(options))
        letters = string.ascii_uppercase[: len(options)]
        prompt["candidates"] = {letters[i]: options[j].id for i, j in enumerate(order)}
    answer = {
        "phases": [
            {
                "id": p.id,
                "formula": p.formula,
                "space_group": p.spacegroup_number,
                "weight_fraction": float(w),
            }
            for p, w in zip(phases, fractions, strict=True)
        ]
    }
    if tier == 1:
        answer["letter"] = next(k for k, v in prompt["candidates"].items() if v == first.id)
    return prompt, answer


def candidate_answer(
    candidates: dict[str, str], letter: str, answer_format: AnswerFormat, library: LibraryVersion = "v0"
) -> str:
    """The reply naming candidate ``letter`` in ``answer_format``.

    A formula gets its space-group symbol appended only when the formula alone
    would not name one candidate: another candidate shares it, or it reads as a
    candidate letter (boron ``B`` among letters A-D).
    """
    if answer_format == "letter":
        return letter
    phases = load_library(library)
    phase = phases.get(candidates[letter])
    clash = phase.formula in candidates or any(
        phases.get(v).formula == phase.formula for k, v in candidates.items() if k != letter
    )
    return f"{phase.formula} {phase.spacegroup_symbol}" if clash else phase.formula


def render_prompt(config: PhaseIdConfig, prompt: dict[str, Any], observed: dict[str, Any]) -> str:
    """The user message: a compact peak list and the question for the tier."""
    library = load_library(config.library)
    tube = "Cu Ka" if config.physics == "v0" else "Cu Ka1 1.54056 Å + Ka2"
    if config.show_widths:
        peaks = " ".join(f"{t:.2f}:{i:.0f}:{w:.2f}" for t, i, w in observed["peaks"])
        head = f"XRD ({tube}) peaks 2θ:I:FWHM"
    else:
        peaks = " ".join(f"{t:.2f}:{i:.0f}" for t, i, _ in observed["peaks"])
        head = f"XRD ({tube}) peaks 2θ:I"
    lines = [f"{head}\n{peaks}"]
    if observed.get("profile"):
        lo, hi, values = observed["profile"]
        lines.append(f"Profile {lo:g}-{hi:g}° counts: " + " ".join(str(v) for v in values))
    tier = prompt["tier"]
    if tier == 1:
        options = " ".join(
            f"{k}) {library.get(v).formula} {library.get(v).spacegroup_symbol}"
            for k, v in prompt["candidates"].items()
        )
        lines.append(f"{options}\nAnswer with the {config.answer_format}.")
    elif tier == 2:
        lines.append(
            f"Elements: {', '.join(prompt['elements'])}. One phase. Answer JSON: "
            '{"phases":[{"formula":"...","space_group":N}]}'
        )
    else:
        lines.append(
            f"Elements: {', '.join(prompt['elements'])}. 2-3 phases. Answer JSON: "
            '{"phases":[{"formula":"...","space_group":N,"weight_fraction":w},...]}'
        )
    return "\n".join(lines)
