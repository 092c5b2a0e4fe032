from __future__ import annotations

import random

from labrl.envs import make
from labrl.envs.types import Action
from labrl.envs.xrd.tasks import candidate_answer
from labrl.verifiers.xrd.library import load_library


async def test_formula_format_asks_for_the_formula_and_scores_gold_and_random_on_format():
    env = make("xrd/phase-id-v0", tier=1, phase_pool=8, answer_format="formula", offload=False)
    task = env.make_task("train", 3)
    library = load_library()
    gold_phase = library.get(task.answer["phases"][0]["id"])
    (gold,) = env.gold_actions(task)
    assert gold.text == gold_phase.formula  # the 8-phase pool has distinct formulas
    obs = await env.reset(task)
    assert obs.messages[0].content.endswith("\nAnswer with the formula.")
    assert (await env.step(gold)).reward == 1.0
    formulas = {library.get(v).formula for v in task.prompt["candidates"].values()}
    rng = random.Random(0)
    replies = {env.random_action(task, rng).text for _ in range(40)}
    assert replies == formulas  # on-format, uniform over the candidates, gold or not
    for reply in sorted(replies):
        await env.reset(task)
        result = await env.step(Action(text=reply))
        assert result.reward == (1.0 if reply == gold_phase.formula else 0.0)


async def test_letter_format_is_unchanged():
    env = make("xrd/phase-id-v0", tier=1, phase_pool=8, offload=False)
    task = env.make_task("train", 3)
    assert env.gold_actions(task)[0].text == task.answer["letter"]
    assert (await env.reset(task)).messages[0].content.endswith("\nAnswer with the letter.")


def test_formula_answer_adds_the_space_group_only_when_the_formula_is_ambiguous():
    library = load_library()
    boron = next(p for p in library if p.formula == "B")
    twins = next((a, b) for a in library for b in library if a.formula == b.formula and a.id < b.id)
    other = next(p for p in library if p.formula not in ("A", "B", "C", twins[0].formula))
    cands = {"A": twins[0].id, "B": twins[1].id, "C": other.id}
    assert candidate_answer(cands, "A", "formula") == f"{twins[0].formula} {twins[0].spacegroup_symbol}"
    assert candidate_answer(cands, "C", "formula") == other.formula
    assert candidate_answer(cands, "C", "letter") == "C"
    # "B" alone would read as the letter B
    with_boron = {"A": other.id, "B": boron.id}
    assert candidate_answer(with_boron, "B", "formula") == f"B {boron.spacegroup_symbol}"
