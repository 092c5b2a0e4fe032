"""Synthesis recipes: what a valid ``synthesis`` job is, for the client and for any lab.

A recipe is what a solid-state chemist writes on the furnace sheet::

    {"precursors": [{"formula": "CaCO3", "mmol": 10}, {"formula": "TiO2", "mmol": 10}],
     "temperature_c": 1200, "time_h": 12, "atmosphere": "air"}

and a ``synthesis`` job is ``{"kind": "synthesis", "recipe": ..., "sample_seed"?: int}``.
This module is the public contract between the ``lab/synthesis`` envs and a
lab: the shelf of precursors (``SHELF``), the phases a lab may report
(``PRODUCTS``, every one a phase of ``labrl.verifiers.xrd``'s library), the
limits a recipe must respect, the targets with a recipe known to make each
(``TARGETS``), and the label-free analysis's candidate phases
(``candidate_phases``). What a lab's furnace then *does* with a recipe is the
lab's business: the mock lab's hidden chemistry is
``labrl.lab_adapters.mock.chemistry``, which nothing outside the mock imports.

Rules (``parse_recipe``; every violation is an ``InvalidActionError`` naming it):

- 1 to ``MAX_PRECURSORS`` precursors, each on the shelf, none listed twice,
  ``0 < mmol <= 1000``;
- ``MIN_TEMPERATURE_C <= temperature_c <= MAX_TEMPERATURE_C``,
  ``0 < time_h <= MAX_TIME_H``;
- ``atmosphere`` one of ``ATMOSPHERES`` (``vacuum``: a sealed evacuated ampoule).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from labrl.errors import InvalidActionError

#: elements exchanged with the atmosphere (carbonates lose CO2, metals take up O in air)
VOLATILE = frozenset({"O", "C"})
ATMOSPHERES = ("air", "O2", "Ar", "N2", "H2", "vacuum")
MIN_TEMPERATURE_C = 20.0
MAX_TEMPERATURE_C = 2000.0
MAX_TIME_H = 500.0
MAX_PRECURSORS = 6

#: precursors on the lab's shelf: formula -> phase id in labrl.verifiers.xrd's library
SHELF: dict[str, str] = {
    # oxides and carbonates
    "CaCO3": "CaCO3_167",
    "TiO2": "TiO2_136",
    "ZrO2": "ZrO2_14",
    "SiO2": "SiO2_152",
    "Al2O3": "Al2O3_167",
    "PbO": "PbO_129",
    "CuO": "CuO_15",
    "Cu2O": "Cu2O_224",
    # elements
    "Cu": "Cu_225",
    "Au": "Au_225",
    "Al": "Al_225",
    "Ti": "Ti_194",
    "Fe": "Fe_229",
    "Si": "Si_227",
    "Zn": "Zn_194",
    "Sn": "Sn_141",
    "Mo": "Mo_229",
    "Pb": "Pb_225",
    "S": "S_70",
}
#: phases a synthesis may produce beyond the shelf's: formula -> phase id
PRODUCTS: dict[str, str] = {
    "CaTiO3": "CaTiO3_62",
    "ZrSiO4": "ZrSiO4_141",
    "PbZrO3": "ZrPbO3_99",
    "Cu3Au": "Cu3Au_221",
    "CuAu": "CuAu_123",
    "Al2Cu": "Al2Cu_140",
    "TiAl3": "TiAl3_139",
    "FeSi": "FeSi_198",
    "FeS2": "FeS2_205",
    "CuS": "CuS_194",
    "CuFeS2": "FeCuS2_122",
    "ZnS": "ZnS_216",
    "ZnS (wurtzite)": "ZnS_186",
    "MoS2": "MoS2_194",
    "SnS": "SnS_62",
}
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


@cache
def element_counts(formula: str) -> dict[str, float]:
    """Atoms per formula unit; a label after a space (``"ZnS (wurtzite)"``) is ignored."""
    from labrl.verifiers.xrd.formula import parse_formula

    return parse_formula(formula.split(" ")[0])


def framework(formula: str) -> dict[str, float]:
    """The non-volatile atoms per formula unit (what the furnace conserves)."""
    return {el: n for el, n in element_counts(formula).items() if el not in VOLATILE}


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
        return frozenset(el for p in self.precursors for el in element_counts(p.formula))


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
    """The submit-time check of a ``synthesis`` job (``{"kind", "recipe", "sample_seed"?}``)."""
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


def candidate_phases(recipe: Recipe) -> list[str]:
    """Phase ids a label-free analysis fits for ``recipe``.

    The shelf and product phases whose non-volatile elements are all among the
    recipe's: what an autonomous lab would consider plausible for that chemical system.
    """
    elements = {el for p in recipe.precursors for el in framework(p.formula)}
    return [
        phase_id
        for formula, phase_id in (SHELF | PRODUCTS).items()
        if framework(formula) and set(framework(formula)) <= elements
    ]
