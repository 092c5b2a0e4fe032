"""Answer extraction and parsing: what the model may write, and the messages it gets back."""

from __future__ import annotations

import re

import pytest

from labrl.errors import InvalidActionError
from labrl.verifiers.answers import extract_choice, extract_json
from labrl.verifiers.xrd.answer import FORMAT_HINT, parse_answer
from labrl.verifiers.xrd.formula import composition_key, parse_formula
from labrl.verifiers.xrd.library import load_library
from labrl.verifiers.xrd.scoring import label_score


def test_formula_parsing():
    assert parse_formula("CaFe(SiO3)2") == {"Ca": 1.0, "Fe": 1.0, "Si": 2.0, "O": 6.0}
    assert composition_key("Na2Cl2") == composition_key("ClNa") == (("Cl", 1.0), ("Na", 1.0))
    with pytest.raises(InvalidActionError, match=re.escape("formula 'Xq2': 'Xq' is not an element symbol")):
        parse_formula("Xq2")
    with pytest.raises(InvalidActionError, match=re.escape("formula 'Na(Cl': unbalanced '('")):
        parse_formula("Na(Cl")


def test_extract_json_variants():
    assert extract_json('so {"a": 1} then finally {"b": [1, 2,],}') == {"b": [1, 2]}
    assert extract_json('<answer>{"x": 2}</answer> {"y": 3}') == {"x": 2}
    assert extract_json('text\n```json\n{"z": 1}\n```\nmore {"w": 0}') == {"z": 1}
    assert extract_json('{"outer": {"inner": 1}}') == {"outer": {"inner": 1}}
    with pytest.raises(InvalidActionError, match=re.escape("no JSON answer found in the reply. hint")):
        extract_json("nothing here", hint="hint")


def test_extract_choice():
    assert extract_choice("B", "ABCD") == "B"
    assert extract_choice(" (C). ", "ABCD") == "C"
    assert extract_choice("I think the answer is D", "ABCD") == "D"
    assert extract_choice("<answer>A</answer>", "ABCD") == "A"
    assert extract_choice("b", "ABCD") is None
    assert extract_choice("E", "ABCD") is None


def test_parse_answer_forms():
    lib = load_library()
    as_ids = lambda claimed: [(c.phase.id, c.weight_fraction) for c in claimed]  # noqa: E731
    assert as_ids(parse_answer("NaCl", lib)) == [("NaCl_225", None)]
    assert as_ids(parse_answer("TiO2 P4_2/mnm", lib)) == [("TiO2_136", None)]
    text = 'Sure. {"phases": [{"formula": "ClNa", "space_group": "Fm-3m"}]} done'
    assert as_ids(parse_answer(text, lib)) == [("NaCl_225", None)]
    both = '{"phases": [{"formula": "NaCl", "space_group": 225, "wt": 60}, {"formula": "TiO2", "sg": 141, "wt": 40}]}'
    assert as_ids(parse_answer(both, lib)) == [("NaCl_225", 0.6), ("TiO2_141", 0.4)]
    cands = {"A": "NaCl_225", "B": "TiO2_136"}
    assert as_ids(parse_answer("B", lib, candidates=cands)) == [("TiO2_136", None)]
    assert as_ids(parse_answer('{"answer": "A"}', lib, candidates=cands)) == [("NaCl_225", None)]
    assert as_ids(parse_answer("TiO2", lib, candidates=cands)) == [("TiO2_136", None)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", f"empty answer. {FORMAT_HINT}"),
        ("TiO2", "TiO2 is ambiguous: give its space group, one of P4_2/mnm (136), I4_1/amd (141), Pbca (61)"),
        (
            '{"phases": [{"formula": "NaCl", "space_group": 12}]}',
            "NaCl with space group 12 is not in the phase library; known: Fm-3m (225)",
        ),
        ('{"phases": [{"formula": "Na3Cl"}]}', "no phase with formula 'Na3Cl' in the phase library"),
        ('{"phases": ["NaCl", "NaCl"]}', "phase(s) listed more than once: ['NaCl_225']"),
        ('{"phases": []}', f'"phases" must be a non-empty list. {FORMAT_HINT}'),
        (
            '{"phases": [{"space_group": 225}]}',
            "each phase needs a \"formula\" string, got {'space_group': 225}.",
        ),
        (
            '{"phases": [{"formula": "NaCl", "space_group": 225, "weight_fraction": "lots"}]}',
            "weight fraction must be a number, got 'lots'",
        ),
        (
            '{"phases": [{"formula": "NaCl", "space_group": 400}]}',
            "space group number must be an integer in 1..230, got 400",
        ),
    ],
)
def test_parse_answer_errors(text, message):
    with pytest.raises(InvalidActionError, match=re.escape(message)):
        parse_answer(text, load_library())


def test_out_of_candidates():
    with pytest.raises(
        InvalidActionError, match=re.escape("'Si' is not one of the candidates: A) NaCl, B) TiO2")
    ):
        parse_answer("Si", load_library(), candidates={"A": "NaCl_225", "B": "TiO2_136"})


def test_label_score_numbers():
    lib = load_library()
    truth = [(lib.get("NaCl_225"), 0.6), (lib.get("TiO2_136"), 0.4)]
    exact = parse_answer('[{"formula":"NaCl","sg":225,"wt":0.6},{"formula":"TiO2","sg":136,"wt":0.4}]', lib)
    assert label_score(exact, truth).reward == pytest.approx(1.0)
    # one right, one wrong polymorph: P = R = 1/2; MAE over {NaCl, TiO2_136, TiO2_141} = (0.1 + 0.4 + 0.3) / 3
    half = parse_answer('[{"formula":"NaCl","sg":225,"wt":0.7},{"formula":"TiO2","sg":141,"wt":0.3}]', lib)
    score = label_score(half, truth)
    assert (score.precision, score.recall, score.f1) == (0.5, 0.5, 0.5)
    assert score.wf_mae == pytest.approx(0.8 / 3)
    assert score.reward == pytest.approx(0.8 * 0.5 + 0.2 * max(0.0, 1 - (0.8 / 3) / 0.25))
    no_weights = parse_answer('["NaCl_225", "TiO2_136"]', lib)
    assert label_score(no_weights, truth).reward == pytest.approx(0.8)
    assert label_score(parse_answer("NaCl", lib), [(lib.get("NaCl_225"), 1.0)]).reward == 1.0
