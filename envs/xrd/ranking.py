"""Does the label-free reward rank the true phase set above wrong ones?

For each generated mixture task (tier 3), the true set competes with wrong
sets built to be hard:

- ``swap``: each true phase in turn replaced by its decoy, the library phase
  sharing an element whose stick pattern is most similar (cosine of 0.5°
  binned patterns, 10–80°) without being identical to it (cosine above
  ``IDENTICAL_COSINE``: the library holds a few XRD-indistinguishable pairs,
  e.g. AFLOW's pyrite FeS2 in Pa-3 and in a P1 setting, which no
  diffraction-based verifier can tell apart);
- ``drop``: the true set without its minor phase;
- ``extra``: the true set plus the decoy of its major phase.

``config`` picks the task family (default: tier 3 of ``xrd/phase-id-v0``; the
v1 tasks with ``PhaseIdConfig(tier=3, library="v1", answer_pool="experimental",
physics="v1")``); decoys come from that config's library.

A task passes when the true set's label-free reward is strictly above every
wrong set's. ``ranking_study`` returns the pass fraction and the details.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from labrl.envs.xrd.measure import observe
from labrl.envs.xrd.tasks import PhaseIdConfig, build_task_prompt
from labrl.verifiers.xrd.fit import fit_phase_ids
from labrl.verifiers.xrd.fit_config import FitConfig
from labrl.verifiers.xrd.library import Phase, PhaseLibrary, load_library, resolve_phase
from labrl.verifiers.xrd.profile import Instrument
from labrl.verifiers.xrd.simulate import stick_pattern

_BINS = np.arange(10.0, 80.5, 0.5)
IDENTICAL_COSINE = 0.9999


@cache
def _fingerprint(phase_id: str) -> np.ndarray:
    sticks = stick_pattern(resolve_phase(phase_id), two_theta_range=(10.0, 80.0))
    hist, _ = np.histogram(sticks.two_theta, bins=_BINS, weights=sticks.scaled)
    return hist / (np.linalg.norm(hist) or 1.0)


def decoy(phase: Phase, exclude: set[str], library: PhaseLibrary | None = None) -> Phase:
    """The library phase sharing an element with ``phase`` whose pattern is most similar to it."""
    library = library if library is not None else load_library()
    pool = [
        p
        for p in library
        if p.id not in exclude and p.id != phase.id and set(p.elements) & set(phase.elements)
    ]
    pool = pool or [p for p in library if p.id not in exclude and p.id != phase.id]
    target = _fingerprint(phase.id)
    similarity = {p.id: float(_fingerprint(p.id) @ target) for p in pool}
    distinct = [p for p in pool if similarity[p.id] <= IDENTICAL_COSINE] or pool
    return max(distinct, key=lambda p: (similarity[p.id], p.id))


@dataclass(frozen=True)
class RankingCase:
    seed: int
    true_ids: tuple[str, ...]
    true_reward: float
    wrong: dict[str, float]  # label of the wrong set -> reward

    @property
    def passed(self) -> bool:
        return all(self.true_reward > r for r in self.wrong.values())


def ranking_case(
    seed: int, split: str = "test", fit: FitConfig | None = None, config: PhaseIdConfig | None = None
) -> RankingCase:
    config = config or PhaseIdConfig(tier=3)
    prompt, answer = build_task_prompt(config, split, seed)  # type: ignore[arg-type]
    obs = observe(prompt["sample"], prompt["noise_seed"], config.n_peaks, 0)
    library = load_library(config.library)
    phases = [library.get(p["id"]) for p in answer["phases"]]
    weights = [p["weight_fraction"] for p in answer["phases"]]
    true_ids = tuple(p.id for p in phases)
    instrument = Instrument.model_validate(prompt["sample"]["instrument"]).model_copy(
        update={"zero_shift": 0.0, "displacement_mm": 0.0}
    )

    def reward(ids: tuple[str, ...]) -> float:
        return fit_phase_ids(obs["two_theta"], obs["counts"], ids, instrument, fit).reward

    wrong_sets: dict[str, tuple[str, ...]] = {}
    for i, p in enumerate(phases):
        d = decoy(p, set(true_ids), library)
        wrong_sets[f"swap {p.id}->{d.id}"] = (*true_ids[:i], d.id, *true_ids[i + 1 :])
    minor = int(np.argmin(weights))
    wrong_sets[f"drop {true_ids[minor]}"] = true_ids[:minor] + true_ids[minor + 1 :]
    major = int(np.argmax(weights))
    extra = decoy(phases[major], set(true_ids), library)
    wrong_sets[f"extra {extra.id}"] = (*true_ids, extra.id)
    return RankingCase(
        seed=seed,
        true_ids=true_ids,
        true_reward=reward(true_ids),
        wrong={label: reward(ids) for label, ids in wrong_sets.items()},
    )


def ranking_study(seeds: range | list[int], split: str = "test") -> tuple[float, list[RankingCase]]:
    cases = [ranking_case(s, split) for s in seeds]
    return sum(c.passed for c in cases) / len(cases), cases
