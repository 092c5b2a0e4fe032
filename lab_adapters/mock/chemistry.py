"""The mock lab's hidden chemistry: recipe -> product phases -> XRD pattern.

Recipes and their rules are public (``labrl.lab_adapters.recipes``); this is
what the mock's furnace does with one, which only the mock knows. Precursors
come from the shelf (``recipes.SHELF``); the products it can make are the
phases of ``CATALOG`` (``recipes.SHELF`` and ``recipes.PRODUCTS`` with their
stability, windows and kinetics), every one a phase of ``labrl.verifiers.xrd``'s
library. The model below is a documented heuristic, not thermodynamics; it
is deterministic per (recipe, seed), and the seed only moves the noise.

1. **Volatiles.** O and C are exchanged with the atmosphere (carbonates lose
   CO2, metals take up O in air); every other element is conserved. A shelf
   phase with ``lost`` rules evaporates before it reacts when the furnace is
   hotter than its limit in that atmosphere (S boils off above 445 °C unless
   the ampoule is sealed, ``vacuum``; PbO above 1000 °C).
2. **Stable set.** A catalog phase may form only inside its temperature
   window ``[t_min_c, t_max_c]`` and in one of its ``atmospheres``.
3. **Equilibrium** (a convex-hull decomposition): the amounts ``a_p >= 0`` of
   the stable phases that conserve every non-volatile element and minimise
   ``Σ_p a_p · n_p · g_p`` (``n_p`` non-volatile atoms per formula unit,
   ``g_p`` a stability per such atom: < 0 for compounds, 0 for the recipe's
   precursors, +0.05 for turning a precursor into another shelf phase, which
   happens only when the atmosphere forces it), solved as a linear program.
   Off-stoichiometric recipes therefore give the
   target plus the neighbouring phases by the lever rule. An element that no
   stable phase can host leaves its precursors unreacted.
4. **Kinetics.** The reaction reaches a fraction ``X = 1 - exp(-t / τ)`` of
   the way from the precursors to equilibrium, ``τ = (t_min / 3) · exp((T_s - T) / 60 °C)``
   with ``(T_s, t_min)`` of the slowest product formed (``X = 0.95`` at
   ``T = T_s`` after ``t_min`` hours). The furnace is off by ``N(0, 5 °C)``
   and ``τ`` by a lognormal factor (σ = 0.1), both drawn from the seed.
5. **Weight fractions** are moles × formula mass, normalised; phases under
   0.5 wt % are below detection and dropped (the rest renormalised).
6. **Measurement.** The product is measured with ``labrl.verifiers.xrd``
   (``mixture.measure``: Hill–Howard scale factors, pseudo-Voigt profiles,
   Poisson counting noise) on an instrument with a seeded zero-shift error
   (U(-0.04°, 0.04°)); crystallites grow with temperature,
   ``L = clip(20 + 0.1 · T, 30, 250) nm``. The result carries the pattern and
   the nominal instrument, never the true phases.

The env's label-free analysis (``recipes.candidate_phases``) fits the public
phases whose non-volatile elements are all among the recipe's.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from labrl.errors import InvalidActionError
from labrl.lab_adapters import recipes
from labrl.lab_adapters.recipes import (
    ATMOSPHERES,
    Recipe,
    element_counts,
    framework,
    validate_synthesis_request,
)

OXIDIZING = frozenset({"air", "O2"})
INERT = frozenset({"Ar", "N2", "vacuum", "H2"})
ALL = frozenset(ATMOSPHERES)
NOT_REDUCING = frozenset({"air", "O2", "Ar", "N2", "vacuum"})
DETECTION_LIMIT = 0.005
THETA_C = 60.0
FURNACE_SIGMA_C = 5.0
TAU_SIGMA = 0.1
SWAP_COST = 0.05  # per atom, for turning a precursor into another shelf phase (see ``equilibrium``)


@dataclass(frozen=True)
class CatalogPhase:
    """One phase the simulated lab can hold or make (see the module docstring)."""

    formula: str
    phase_id: str  # in labrl.verifiers.xrd's library
    g: float = 0.0  # stability per non-volatile atom (0 for shelf phases)
    t_min_c: float = -273.0
    t_max_c: float = 5000.0
    atmospheres: frozenset[str] = ALL
    on_shelf: bool = False
    synthesis_c: float | None = None  # T_s of the kinetics (products only)
    min_time_h: float | None = None  # t_min of the kinetics (products only)
    lost: tuple[tuple[frozenset[str], float], ...] = field(default=())  # (atmospheres, above °C)

    def stable(self, temperature_c: float, atmosphere: str) -> bool:
        return self.t_min_c <= temperature_c <= self.t_max_c and atmosphere in self.atmospheres

    def is_lost(self, temperature_c: float, atmosphere: str) -> bool:
        return any(atmosphere in atms and temperature_c > limit for atms, limit in self.lost)


def _shelf(formula: str, **kw: Any) -> CatalogPhase:
    return CatalogPhase(formula, recipes.SHELF[formula], on_shelf=True, **kw)


def _product(formula: str, g: float, t_s: float, t_min_h: float, **kw: Any) -> CatalogPhase:
    return CatalogPhase(formula, recipes.PRODUCTS[formula], g=g, synthesis_c=t_s, min_time_h=t_min_h, **kw)


_SEALED_ONLY = ((frozenset({"air", "O2"}), 250.0), (frozenset({"Ar", "N2", "H2"}), 445.0))
CATALOG: tuple[CatalogPhase, ...] = (
    # shelf: oxides and carbonates
    _shelf("CaCO3"),
    _shelf("TiO2"),
    _shelf("ZrO2"),
    _shelf("SiO2"),
    _shelf("Al2O3"),
    _shelf("PbO", atmospheres=NOT_REDUCING, lost=((NOT_REDUCING - {"vacuum"}, 1000.0),)),
    _shelf("CuO", t_max_c=1030.0, atmospheres=OXIDIZING),
    _shelf("Cu2O", atmospheres=frozenset({"Ar", "N2", "vacuum"})),
    # shelf: elements (metals oxidise in air when an oxide of theirs is in the catalog)
    _shelf("Cu", atmospheres=INERT),
    _shelf("Au"),
    _shelf("Al", atmospheres=INERT),
    _shelf("Ti", atmospheres=INERT),
    _shelf("Fe", atmospheres=INERT),
    _shelf("Si", atmospheres=INERT),
    _shelf("Zn", atmospheres=INERT),
    _shelf("Sn", atmospheres=INERT),
    _shelf("Mo", atmospheres=INERT),
    _shelf("Pb", atmospheres=INERT),
    _shelf("S", atmospheres=INERT, lost=_SEALED_ONLY),
    # products
    _product("CaTiO3", -0.5, 1150.0, 8.0, t_min_c=600.0),
    _product("ZrSiO4", -0.4, 1450.0, 12.0, t_max_c=1650.0, atmospheres=NOT_REDUCING),
    _product("PbZrO3", -0.4, 850.0, 4.0, atmospheres=NOT_REDUCING),
    _product("Cu3Au", -0.07, 320.0, 24.0, t_max_c=390.0, atmospheres=INERT),
    _product("CuAu", -0.09, 340.0, 24.0, t_max_c=410.0, atmospheres=INERT),
    _product("Al2Cu", -0.15, 480.0, 6.0, t_max_c=590.0, atmospheres=INERT),
    _product("TiAl3", -0.4, 900.0, 8.0, t_max_c=1380.0, atmospheres=INERT),
    _product("FeSi", -0.35, 1000.0, 10.0, t_max_c=1400.0, atmospheres=INERT),
    _product("FeS2", -0.6, 500.0, 48.0, t_max_c=740.0, atmospheres=INERT),
    _product("CuS", -0.45, 350.0, 24.0, t_max_c=507.0, atmospheres=INERT),
    _product("CuFeS2", -0.75, 550.0, 48.0, t_max_c=800.0, atmospheres=INERT),
    _product("ZnS", -1.0, 650.0, 12.0, t_max_c=1020.0, atmospheres=INERT),
    _product("ZnS (wurtzite)", -1.0, 1050.0, 12.0, t_min_c=1020.0, atmospheres=INERT),
    _product("MoS2", -0.8, 800.0, 24.0, t_max_c=1500.0, atmospheres=INERT),
    _product("SnS", -0.5, 600.0, 12.0, t_max_c=880.0, atmospheres=INERT),
)
SHELF: dict[str, CatalogPhase] = {p.formula: p for p in CATALOG if p.on_shelf}
PRODUCTS: dict[str, CatalogPhase] = {p.phase_id: p for p in CATALOG if not p.on_shelf}


# -- the synthesis model ---------------------------------------------------------


@cache
def formula_mass(formula: str) -> float:
    """Grams per mole of formula units."""
    from ase.data import atomic_masses, atomic_numbers

    return float(sum(n * atomic_masses[atomic_numbers[el]] for el, n in element_counts(formula).items()))


class Product(BaseModel):
    """What came out of the furnace (the truth the lab knows and never reports)."""

    model_config = ConfigDict(frozen=True)

    weight_fractions: dict[str, float]  # phase id -> w
    moles: dict[str, float]  # phase id -> mmol of formula units
    conversion: float
    furnace_c: float
    lost: tuple[str, ...]
    unreacted_inert: tuple[str, ...]


def _rng(recipe: Recipe, seed: int, stream: str) -> random.Random:
    digest = hashlib.sha256(f"{stream}:{seed}:{json.dumps(recipe.to_json(), sort_keys=True)}".encode())
    return random.Random(int.from_bytes(digest.digest()[:8], "big"))


def equilibrium(
    moles: dict[str, float], phases: list[CatalogPhase], keep: frozenset[str] = frozenset()
) -> dict[str, float] | None:
    """Minimum-``Σ a n g`` amounts of ``phases`` that hold exactly ``moles`` of each element; None if impossible.

    Shelf phases not in ``keep`` (the recipe's precursors) cost ``SWAP_COST`` per atom: with O
    exchanged freely, TiO2 and Ti would otherwise tie, and inert gas would "reduce" oxides.
    A swap the atmosphere forces (Cu -> CuO in air: Cu is not stable there) still happens.
    """
    from scipy.optimize import linprog

    elements = sorted(moles)
    a_eq = np.array([[framework(p.formula).get(el, 0.0) for p in phases] for el in elements])  # (E, P)
    b_eq = np.array([moles[el] for el in elements])  # (E,)
    g = [SWAP_COST if p.on_shelf and p.phase_id not in keep else p.g for p in phases]
    cost = np.array([gp * sum(framework(p.formula).values()) for gp, p in zip(g, phases, strict=True)])
    solved = linprog(cost, A_eq=a_eq, b_eq=b_eq, bounds=[(0, None)] * len(phases), method="highs")
    if solved.status != 0:
        return None
    return {p.phase_id: float(x) for p, x in zip(phases, solved.x, strict=True) if x > 1e-9}


def synthesize(recipe: Recipe, seed: int = 0) -> Product:
    """Run the heuristic of the module docstring on ``recipe``; deterministic per (recipe, seed)."""
    noise = _rng(recipe, seed, "furnace")
    furnace = recipe.temperature_c + noise.gauss(0.0, FURNACE_SIGMA_C)
    tau_noise = math.exp(noise.gauss(0.0, TAU_SIGMA))
    atmosphere = recipe.atmosphere
    lost = tuple(p.formula for p in recipe.precursors if SHELF[p.formula].is_lost(furnace, atmosphere))
    start = {SHELF[p.formula].phase_id: p.mmol for p in recipe.precursors if p.formula not in lost}
    by_id = {p.phase_id: p for p in CATALOG}

    # elements no stable phase can host keep their precursors out of the reaction
    stable = [p for p in CATALOG if p.stable(furnace, atmosphere)]
    hosted = {el for p in stable for el in framework(p.formula)}
    inert = {pid for pid in start if not set(framework(by_id[pid].formula)) <= hosted}
    reacting = {pid: n for pid, n in start.items() if pid not in inert}
    moles: dict[str, float] = {}
    for pid, n in reacting.items():
        for el, k in framework(by_id[pid].formula).items():
            moles[el] = moles.get(el, 0.0) + n * k
    candidates = [p for p in stable if set(framework(p.formula)) <= set(moles) and framework(p.formula)]
    final = equilibrium(moles, candidates, frozenset(reacting)) if moles else {}
    if final is None:  # cannot happen while every element has a host; kept as a guard
        final, conversion = dict(reacting), 0.0
    else:
        formed = [by_id[pid] for pid in final if not by_id[pid].on_shelf]
        if formed:
            slowest = max(formed, key=lambda p: p.synthesis_c or 0.0)
            assert slowest.synthesis_c is not None and slowest.min_time_h is not None
            tau = slowest.min_time_h / 3.0 * math.exp((slowest.synthesis_c - furnace) / THETA_C) * tau_noise
            conversion = 1.0 - math.exp(-recipe.time_h / tau)
        else:
            conversion = 1.0  # oxidation/redox of the precursors alone: fast at these times
    amounts: dict[str, float] = {}
    for pid, n in final.items():
        amounts[pid] = amounts.get(pid, 0.0) + conversion * n
    for pid, n in reacting.items():
        amounts[pid] = amounts.get(pid, 0.0) + (1.0 - conversion) * n
    for pid in inert:
        amounts[pid] = amounts.get(pid, 0.0) + start[pid]
    masses = {pid: n * formula_mass(by_id[pid].formula) for pid, n in amounts.items() if n > 0}
    total = sum(masses.values())
    fractions = {pid: m / total for pid, m in masses.items()} if total > 0 else {}
    fractions = {pid: w for pid, w in fractions.items() if w >= DETECTION_LIMIT}
    norm = sum(fractions.values())
    fractions = {pid: w / norm for pid, w in sorted(fractions.items())}
    return Product(
        weight_fractions=fractions,
        moles={pid: round(n, 9) for pid, n in sorted(amounts.items()) if n > 1e-12},
        conversion=conversion,
        furnace_c=furnace,
        lost=lost,
        unreacted_inert=tuple(sorted(inert)),
    )


# -- the measurement --------------------------------------------------------------


def nominal_instrument() -> Any:
    from labrl.verifiers.xrd.profile import Instrument

    return Instrument()


def crystallite_nm(temperature_c: float) -> float:
    return float(min(250.0, max(30.0, 20.0 + 0.1 * temperature_c)))


def measure_product(product: Product, recipe: Recipe, seed: int) -> dict[str, Any]:
    """The XRD pattern of ``product`` (JSON: grid, integer counts, the nominal instrument)."""
    from labrl.verifiers.xrd.mixture import Component, Sample, measure

    if not product.weight_fractions:
        raise InvalidActionError("the crucible came out empty: every precursor evaporated")
    rng = _rng(recipe, seed, "xrd")
    nominal = nominal_instrument()
    instrument = nominal.model_copy(update={"zero_shift": rng.uniform(-0.04, 0.04)})
    size = crystallite_nm(product.furnace_c)
    fractions = product.weight_fractions
    total = sum(fractions.values())
    components = tuple(
        Component(phase_id=pid, weight_fraction=w / total, crystallite_nm=size)
        for pid, w in fractions.items()
    )
    sample = Sample(components=components, instrument=instrument)
    measurement = measure(sample, seed=rng.randrange(2**32))
    grid = measurement.two_theta
    return {
        "two_theta_min": float(grid[0]),
        "step": float(grid[1] - grid[0]),
        "counts": [int(c) for c in measurement.counts],
        "instrument": nominal.model_dump(mode="json"),
    }


def run_synthesis(request: dict[str, Any], seed: int) -> dict[str, Any]:
    """Execute a ``synthesis`` job: synthesise, then measure. ``seed`` comes from the mock (request hash)."""
    from threadpoolctl import threadpool_limits

    recipe = validate_synthesis_request(request)
    sample_seed = int(request.get("sample_seed", 0))
    with threadpool_limits(limits=1, user_api="blas"):  # small problems: BLAS threads only spin
        product = synthesize(recipe, sample_seed)
        xrd = measure_product(product, recipe, sample_seed + seed)
    return {"recipe": recipe.to_json(), "xrd": xrd}
