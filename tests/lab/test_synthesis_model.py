"""The mock lab's synthesis heuristic, checked by hand, and its XRD measurement."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from labrl.errors import InvalidActionError
from labrl.lab_adapters import recipes
from labrl.lab_adapters.mock import simlab
from labrl.lab_adapters.mock.chemistry import (
    CATALOG,
    SHELF,
    equilibrium,
    formula_mass,
    measure_product,
    run_synthesis,
    synthesize,
)
from labrl.lab_adapters.recipes import TARGETS, candidate_phases, gold_recipe, parse_recipe
from labrl.verifiers.xrd.library import load_library


def recipe_json(
    precursors: list[tuple[str, float]],
    temperature_c: float = 900,
    time_h: float = 1,
    atmosphere: str = "air",
) -> dict:
    """A recipe as the agent writes it, precursors as ``(formula, mmol)`` pairs."""
    return {
        "precursors": [{"formula": f, "mmol": n} for f, n in precursors],
        "temperature_c": temperature_c,
        "time_h": time_h,
        "atmosphere": atmosphere,
    }


def recipe(precursors: dict[str, float], temperature_c: float, time_h: float, atmosphere: str):
    return parse_recipe(recipe_json(list(precursors.items()), temperature_c, time_h, atmosphere))


def test_catalog_phases_are_in_the_xrd_library():
    library = load_library()
    assert all(p.phase_id in library for p in CATALOG)
    assert set(TARGETS) <= {p.phase_id for p in CATALOG if not p.on_shelf}


def test_mock_catalog_is_exactly_the_public_shelf_and_products():
    """The hidden chemistry adds thermodynamics to the public phases, never a phase of its own."""
    assert [(p.formula, p.phase_id) for p in CATALOG if p.on_shelf] == list(recipes.SHELF.items())
    assert [(p.formula, p.phase_id) for p in CATALOG if not p.on_shelf] == list(recipes.PRODUCTS.items())


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_gold_recipes_make_the_target_phase_pure(target):
    product = synthesize(parse_recipe(gold_recipe(target)), seed=3)
    assert product.weight_fractions == {target: 1.0}
    assert product.conversion > 0.999


def test_stoichiometric_excess_stays_as_unreacted_precursor():
    # 15 CaCO3 + 10 TiO2 at full conversion -> 10 CaTiO3 + 5 CaCO3 (lever rule); O and C exchanged
    product = synthesize(recipe({"CaCO3": 15, "TiO2": 10}, 1200, 200, "air"), seed=0)
    m_ct, m_cc = 10 * formula_mass("CaTiO3"), 5 * formula_mass("CaCO3")
    assert product.moles == pytest.approx({"CaTiO3_62": 10.0, "CaCO3_167": 5.0}, rel=1e-6, abs=1e-6)
    assert product.weight_fractions["CaTiO3_62"] == pytest.approx(m_ct / (m_ct + m_cc), rel=1e-6)
    assert product.weight_fractions["CaTiO3_62"] == pytest.approx(0.7310, abs=1e-3)


def test_off_ratio_binary_gives_the_neighbouring_compounds():
    # Cu:Au = 15:10 lies between Cu3Au (x_Au = 1/4) and CuAu (1/2): 2.5 Cu3Au + 7.5 CuAu
    product = synthesize(recipe({"Cu": 15, "Au": 10}, 360, 400, "Ar"), seed=0)
    assert product.moles == pytest.approx({"Cu3Au_221": 2.5, "CuAu_123": 7.5}, rel=2e-3)


def test_kinetics_follow_the_documented_rate_law():
    # CaTiO3: T_s = 1150 °C, t_min = 8 h: X = 1 - exp(-t / ((8/3) exp((1150 - T)/60))) (furnace and rate noise)
    product = synthesize(recipe({"CaCO3": 10, "TiO2": 10}, 1000, 4, "air"), seed=0)
    nominal = 1 - math.exp(-4 / (8 / 3 * math.exp(150 / 60)))
    assert nominal == pytest.approx(0.1158, abs=1e-4)
    assert product.conversion == pytest.approx(nominal, rel=0.35)
    assert product.moles["CaTiO3_62"] == pytest.approx(10 * product.conversion, rel=1e-6)
    assert product.moles["TiO2_136"] == pytest.approx(10 * (1 - product.conversion), rel=1e-6)


def test_temperature_window_and_atmosphere():
    # above its window (390 °C) Cu3Au does not form: the elements stay apart
    hot = synthesize(recipe({"Cu": 15, "Au": 5}, 600, 48, "Ar"), seed=0)
    assert set(hot.weight_fractions) == {"Cu_225", "Au_225"}
    # in air copper oxidises to CuO and gold stays
    air = synthesize(recipe({"Cu": 15, "Au": 5}, 360, 48, "air"), seed=0)
    assert air.moles == pytest.approx({"CuO_15": 15.0, "Au_225": 5.0})
    # no reductant in N2: TiO2 stays TiO2 (not Ti metal) and Si stays Si; H2 reduces CuO to Cu
    n2 = synthesize(recipe({"Si": 15, "TiO2": 20}, 800, 12, "N2"), seed=0)
    assert n2.moles == pytest.approx({"Si_227": 15.0, "TiO2_136": 20.0})
    assert synthesize(recipe({"CuO": 15}, 600, 48, "H2"), seed=0).moles == pytest.approx({"Cu_225": 15.0})
    # ZnS: sphalerite below 1020 °C, wurtzite above
    assert set(synthesize(recipe({"Zn": 10, "S": 10}, 1150, 24, "vacuum"), 0).weight_fractions) == {"ZnS_186"}


def test_volatile_precursors_are_lost_above_their_limit():
    # sulfur boils off in flowing argon (445 °C): iron stays unreacted
    product = synthesize(recipe({"Fe": 10, "S": 20}, 550, 96, "Ar"), seed=0)
    assert product.lost == ("S",) and product.weight_fractions == {"Fe_229": 1.0}
    # PbO evaporates above 1000 °C in an open furnace: only ZrO2 is left
    pbo = synthesize(recipe({"PbO": 10, "ZrO2": 10}, 1100, 8, "air"), seed=0)
    assert pbo.lost == ("PbO",) and pbo.weight_fractions == {"ZrO2_14": 1.0}


def test_element_without_a_host_keeps_its_precursor_unreacted():
    # iron has no oxide in the catalog: in air Fe stays as it is, while Si oxidises to SiO2
    product = synthesize(recipe({"Fe": 10, "Si": 10}, 1050, 20, "air"), seed=0)
    assert product.unreacted_inert == ("Fe_229",)
    assert product.moles == pytest.approx({"Fe_229": 10.0, "SiO2_152": 10.0})


def test_equilibrium_is_the_lower_hull():
    by_id = {p.phase_id: p for p in CATALOG}
    phases = [by_id[i] for i in ("Cu_225", "Au_225", "Cu3Au_221", "CuAu_123")]
    assert equilibrium({"Cu": 3.0, "Au": 1.0}, phases) == pytest.approx({"Cu3Au_221": 1.0})
    assert equilibrium({"Cu": 4.0, "Au": 1.0}, phases) == pytest.approx({"Cu3Au_221": 1.0, "Cu_225": 1.0})
    assert equilibrium({"Cu": 1.0}, [by_id["Au_225"]]) is None


def test_deterministic_per_recipe_and_seed_with_seeded_noise():
    r = recipe({"CaCO3": 10, "TiO2": 10}, 1050, 3, "air")
    assert synthesize(r, 1) == synthesize(r, 1)
    assert synthesize(r, 1).furnace_c != synthesize(r, 2).furnace_c
    assert measure_product(synthesize(r, 1), r, 1) == measure_product(synthesize(r, 1), r, 1)
    assert (
        measure_product(synthesize(r, 1), r, 1)["counts"] != measure_product(synthesize(r, 1), r, 2)["counts"]
    )


def test_measurement_is_a_noisy_pattern_with_the_target_peaks():
    r = parse_recipe(gold_recipe("ZnS_216"))
    xrd = measure_product(synthesize(r, 0), r, 0)
    counts = np.asarray(xrd["counts"], dtype=float)
    grid = xrd["two_theta_min"] + xrd["step"] * np.arange(len(counts))
    assert len(counts) == 3501 and xrd["instrument"]["zero_shift"] == 0.0
    # sphalerite (111) at 2θ ≈ 28.5° with Cu Kα is the strongest line
    assert abs(grid[np.argmax(counts)] - 28.5) < 0.3
    assert set(xrd) == {"two_theta_min", "step", "counts", "instrument"}  # the true phases are not reported


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("CaTiO3", "a recipe must be a JSON object, got str"),
        (recipe_json([]), "invalid recipe: precursors:"),
        (recipe_json([("Xx2O3", 1)]), "formula 'Xx2O3': 'Xx' is not an element symbol"),
        (recipe_json([("BaCO3", 1)]), "precursor 'BaCO3' is not on the lab's shelf; available: CaCO3, TiO2"),
        (
            recipe_json([("Cu", 1)], temperature_c=1e6),
            "invalid recipe: temperature_c: Input should be less than or equal to 2000",
        ),
        (
            recipe_json([("Cu", 1)], temperature_c=500, atmosphere="plasma"),
            "invalid recipe: atmosphere: Value error, unknown atmosphere 'plasma'",
        ),
        (recipe_json([("Cu", 1)] * 2, temperature_c=500, atmosphere="Ar"), "precursor 'Cu' is listed twice"),
        (
            recipe_json([("Cu", -1)], temperature_c=500, atmosphere="Ar"),
            "invalid recipe: precursors.0.mmol: Input should be greater than 0",
        ),
    ],
)
def test_invalid_recipes_are_refused_with_a_message(data, message):
    with pytest.raises(InvalidActionError, match=re.escape(message)):
        parse_recipe(data)


def test_simlab_runs_synthesis_jobs():
    assert "synthesis" in simlab.kinds()
    request = {"kind": "synthesis", "recipe": gold_recipe("FeSi_198"), "sample_seed": 2}
    simlab.validate(request)
    result = simlab.execute(request, seed=5)
    assert result == run_synthesis(request, 5)
    assert result["recipe"]["atmosphere"] == "Ar" and len(result["xrd"]["counts"]) == 3501
    with pytest.raises(InvalidActionError, match=re.escape("unknown field(s) in a synthesis job: truth")):
        simlab.validate({**request, "truth": True})


def test_candidate_phases_are_the_chemical_system():
    r = recipe({"CaCO3": 10, "TiO2": 10}, 1200, 16, "air")
    assert candidate_phases(r) == ["CaCO3_167", "TiO2_136", "Ti_194", "CaTiO3_62"]
    assert "Cu" in SHELF and "CuO" in SHELF
