"""The mock lab's simulated synthesis: recipe -> product phases -> XRD pattern.

A recipe is what a solid-state chemist writes on the furnace sheet::

    {"precursors": [{"formula": "CaCO3", "mmol": 10}, {"formula": "TiO2", "mmol": 10}],
     "temperature_c": 1200, "time_h": 12, "atmosphere": "air"}

Precursors come from the lab's shelf (``SHELF``); the products it can make are
the phases of ``CATALOG``, every one a phase of ``labrl.verifiers.xrd``'s
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

The lab's label-free analysis (``candidate_phases``) fits the catalog phases
whose non-volatile elements are all among the recipe's: what an autonomous
lab would consider plausible for that chemical system.
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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from labrl.errors import InvalidActionError

VOLATILE = frozenset({"O", "C"})
ATMOSPHERES = ("air", "O2", "Ar", "N2", "H2", "vacuum")
OXIDIZING = frozenset({"air", "O2"})
INERT = frozenset({"Ar", "N2", "vacuum", "H2"})
ALL = frozenset(ATMOSPHERES)
NOT_REDUCING = frozenset({"air", "O2", "Ar", "N2", "vacuum"})
MIN_TEMPERATURE_C = 20.0
MAX_TEMPERATURE_C = 2000.0
MAX_TIME_H = 500.0
MAX_PRECURSORS = 6
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


def _shelf(formula: str, phase_id: str, **kw: Any) -> CatalogPhase:
    return CatalogPhase(formula, phase_id, on_shelf=True, **kw)


def _product(formula: str, phase_id: str, g: float, t_s: float, t_min_h: float, **kw: Any) -> CatalogPhase:
    return CatalogPhase(formula, phase_id, g=g, synthesis_c=t_s, min_time_h=t_min_h, **kw)


_SEALED_ONLY = ((frozenset({"air", "O2"}), 250.0), (frozenset({"Ar", "N2", "H2"}), 445.0))
CATALOG: tuple[CatalogPhase, ...] = (
    # shelf: oxides and carbonates
    _shelf("CaCO3", "CaCO3_167"),
    _shelf("TiO2", "TiO2_136"),
    _shelf("ZrO2", "ZrO2_14"),
    _shelf("SiO2", "SiO2_152"),
    _shelf("Al2O3", "Al2O3_167"),
    _shelf("PbO", "PbO_129", atmospheres=NOT_REDUCING, lost=((NOT_REDUCING - {"vacuum"}, 1000.0),)),
    _shelf("CuO", "CuO_15", t_max_c=1030.0, atmospheres=OXIDIZING),
    _shelf("Cu2O", "Cu2O_224", atmospheres=frozenset({"Ar", "N2", "vacuum"})),
    # shelf: elements (metals oxidise in air when an oxide of theirs is in the catalog)
    _shelf("Cu", "Cu_225", atmospheres=INERT),
    _shelf("Au", "Au_225"),
    _shelf("Al", "Al_225", atmospheres=INERT),
    _shelf("Ti", "Ti_194", atmospheres=INERT),
    _shelf("Fe", "Fe_229", atmospheres=INERT),
    _shelf("Si", "Si_227", atmospheres=INERT),
    _shelf("Zn", "Zn_194", atmospheres=INERT),
    _shelf("Sn", "Sn_141", atmospheres=INERT),
    _shelf("Mo", "Mo_229", atmospheres=INERT),
    _shelf("Pb", "Pb_225", atmospheres=INERT),
    _shelf("S", "S_70", atmospheres=INERT, lost=_SEALED_ONLY),
    # products
    _product("CaTiO3", "CaTiO3_62", -0.5, 1150.0, 8.0, t_min_c=600.0),
    _product("ZrSiO4", "ZrSiO4_141", -0.4, 1450.0, 12.0, t_max_c=1650.0, atmospheres=NOT_REDUCING),
    _product("PbZrO3", "ZrPbO3_99", -0.4, 850.0, 4.0, atmospheres=NOT_REDUCING),
    _product("Cu3Au", "Cu3Au_221", -0.07, 320.0, 24.0, t_max_c=390.0, atmospheres=INERT),
    _product("CuAu", "CuAu_123", -0.09, 340.0, 24.0, t_max_c=410.0, atmospheres=INERT),
    _product("Al2Cu", "Al2Cu_140", -0.15, 480.0, 6.0, t_max_c=590.0, atmospheres=INERT),
    _product("TiAl3", "TiAl3_139", -0.4, 900.0, 8.0, t_max_c=1380.0, atmospheres=INERT),
    _product("FeSi", "FeSi_198", -0.35, 1000.0, 10.0, t_max_c=1400.0, atmospheres=INERT),
    _product("FeS2", "FeS2_205", -0.6, 500.0, 48.0, t_max_c=740.0, atmospheres=INERT),
    _product("CuS", "CuS_194", -0.45, 350.0, 24.0, t_max_c=507.0, atmospheres=INERT),
    _product("CuFeS2", "FeCuS2_122", -0.75, 550.0, 48.0, t_max_c=800.0, atmospheres=INERT),
    _product("ZnS", "ZnS_216", -1.0, 650.0, 12.0, t_max_c=1020.0, atmospheres=INERT),
    _product("ZnS (wurtzite)", "ZnS_186", -1.0, 1050.0, 12.0, t_min_c=1020.0, atmospheres=INERT),
    _product("MoS2", "MoS2_194", -0.8, 800.0, 24.0, t_max_c=1500.0, atmospheres=INERT),
    _product("SnS", "SnS_62", -0.5, 600.0, 12.0, t_max_c=880.0, atmospheres=INERT),
)
SHELF: dict[str, CatalogPhase] = {p.formula: p for p in CATALOG if p.on_shelf}
PRODUCTS: dict[str, CatalogPhase] = {p.phase_id: p for p in CATALOG if not p.on_shelf}
#: the targets an env may ask for, with a recipe that makes each nearly phase-pure
TARGETS: dict[str, dict[str, Any]] = {
    "CaTiO3_62": {"precursors": {"CaCO3": 10, "TiO2": 10}, "temperature_c": 1200, "time_h": 16, "atmosphere": "air"},
    "ZrSiO4_141": {"precursors": {"ZrO2": 10, "SiO2": 10}, "temperature_c": 1500, "time_h": 24, "atmosphere": "air"},
    "ZrPbO3_99": {"precursors": {"PbO": 10, "ZrO2": 10}, "temperature_c": 900, "time_h": 8, "atmosphere": "air"},
    "Cu3Au_221": {"precursors": {"Cu": 15, "Au": 5}, "temperature_c": 360, "time_h": 48, "atmosphere": "Ar"},
    "CuAu_123": {"precursors": {"Cu": 10, "Au": 10}, "temperature_c": 380, "time_h": 48, "atmosphere": "Ar"},
    "Al2Cu_140": {"precursors": {"Al": 20, "Cu": 10}, "temperature_c": 530, "time_h": 12, "atmosphere": "Ar"},
    "TiAl3_139": {"precursors": {"Ti": 5, "Al": 15}, "temperature_c": 950, "time_h": 16, "atmosphere": "Ar"},
    "FeSi_198": {"precursors": {"Fe": 10, "Si": 10}, "temperature_c": 1050, "time_h": 20, "atmosphere": "Ar"},
    "FeS2_205": {"precursors": {"Fe": 10, "S": 20}, "temperature_c": 550, "time_h": 96, "atmosphere": "vacuum"},
    "FeCuS2_122": {"precursors": {"Cu": 10, "Fe": 10, "S": 20}, "temperature_c": 600, "time_h": 96, "atmosphere": "vacuum"},
    "ZnS_216": {"precursors": {"Zn": 10, "S": 10}, "temperature_c": 700, "time_h": 24, "atmosphere": "vacuum"},
    "MoS2_194": {"precursors": {"Mo": 10, "S": 20}, "temperature_c": 850, "time_h": 48, "atmosphere": "vacuum"},
    "SnS_62": {"precursors": {"Sn": 10, "S": 10}, "temperature_c": 650, "time_h": 24, "atmosphere": "vacuum"},
}  # fmt: skip


# -- recipes ---------------------------------------------------------------------


class Precursor(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    formula: str
    mmol: float = Field(gt=0.0, le=1000.0, allow_inf_nan=False)


class Recipe(BaseModel):
    """A validated recipe; ``parse_recipe`` builds one with messages meant for the model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    precursors: tuple[Precursor, ...] = Field(min_length=1, max_length=MAX_PRECURSORS)
    temperature_c: float = Field(ge=MIN_TEMPERATURE_C, le=MAX_TEMPERATURE_C, allow_inf_nan=False)
    time_h: float = Field(gt=0.0, le=MAX_TIME_H, allow_inf_nan=False)
    atmosphere: str

    @field_validator("atmosphere")
    @classmethod
    def _known_atmosphere(cls, value: str) -> str:
        if value not in ATMOSPHERES:
            raise ValueError(f"unknown atmosphere {value!r}; choose one of {', '.join(ATMOSPHERES)}")
        return value

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @property
    def elements(self) -> frozenset[str]:
        return frozenset(el for p in self.precursors for el in _counts(p.formula))


def parse_recipe(data: Any) -> Recipe:
    """A ``Recipe`` from JSON-like ``data``; ``InvalidActionError`` names what is wrong."""
    if not isinstance(data, dict):
        raise InvalidActionError(f"a recipe must be a JSON object, got {type(data).__name__}")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or 'recipe'}: {err['msg']}" for err in exc.errors()
        )
        raise InvalidActionError(f"invalid recipe: {problems}") from None
    from labrl.verifiers.xrd.formula import parse_formula

    seen: set[str] = set()
    for precursor in recipe.precursors:
        parse_formula(precursor.formula)  # unknown element symbols are named here
        if precursor.formula not in SHELF:
            raise InvalidActionError(
                f"precursor {precursor.formula!r} is not on the lab's shelf; available: {', '.join(SHELF)}"
            )
        if precursor.formula in seen:
            raise InvalidActionError(f"precursor {precursor.formula!r} is listed twice")
        seen.add(precursor.formula)
    return recipe


def validate_synthesis_request(request: dict[str, Any]) -> Recipe:
    """The mock's submit-time check of a ``synthesis`` job (``{"kind", "recipe", "sample_seed"?}``)."""
    extra = set(request) - {"kind", "recipe", "sample_seed"}
    if extra:
        raise InvalidActionError(f"unknown field(s) in a synthesis job: {', '.join(sorted(extra))}")
    seed = request.get("sample_seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise InvalidActionError(f"sample_seed must be a non-negative integer, got {seed!r}")
    return parse_recipe(request.get("recipe"))


def gold_recipe(target: str) -> dict[str, Any]:
    """A recipe (JSON) that makes ``target`` nearly phase-pure."""
    spec = TARGETS[target]
    return {
        "precursors": [{"formula": f, "mmol": n} for f, n in spec["precursors"].items()],
        "temperature_c": spec["temperature_c"],
        "time_h": spec["time_h"],
        "atmosphere": spec["atmosphere"],
    }


# -- the synthesis model ---------------------------------------------------------


@cache
def _counts(formula: str) -> dict[str, float]:
    from labrl.verifiers.xrd.formula import parse_formula

    return parse_formula(formula.split(" ")[0])


def _framework(formula: str) -> dict[str, float]:
    return {el: n for el, n in _counts(formula).items() if el not in VOLATILE}


@cache
def formula_mass(formula: str) -> float:
    """Grams per mole of formula units."""
    from ase.data import atomic_masses, atomic_numbers

    return float(sum(n * atomic_masses[atomic_numbers[el]] for el, n in _counts(formula).items()))


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
    a_eq = np.array([[_framework(p.formula).get(el, 0.0) for p in phases] for el in elements])  # (E, P)
    b_eq = np.array([moles[el] for el in elements])  # (E,)
    g = [SWAP_COST if p.on_shelf and p.phase_id not in keep else p.g for p in phases]
    cost = np.array([gp * sum(_framework(p.formula).values()) for gp, p in zip(g, phases, strict=True)])
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
    hosted = {el for p in stable for el in _framework(p.formula)}
    inert = {pid for pid in start if not set(_framework(by_id[pid].formula)) <= hosted}
    reacting = {pid: n for pid, n in start.items() if pid not in inert}
    moles: dict[str, float] = {}
    for pid, n in reacting.items():
        for el, k in _framework(by_id[pid].formula).items():
            moles[el] = moles.get(el, 0.0) + n * k
    candidates = [p for p in stable if set(_framework(p.formula)) <= set(moles) and _framework(p.formula)]
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


def candidate_phases(recipe: Recipe) -> list[str]:
    """Phase ids the lab's label-free analysis fits for ``recipe`` (module docstring)."""
    elements = {el for p in recipe.precursors for el in _framework(p.formula)}
    return [p.phase_id for p in CATALOG if _framework(p.formula) and set(_framework(p.formula)) <= elements]
