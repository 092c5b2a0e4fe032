"""Grade one response against a rubric: deterministic items, LLM judges, ensembles.

``RubricGrader(judges, aggregate).grade(rubric, response, question)``:

1. deterministic items (regex, contains, numeric) are scored locally;
2. every judge scores every ``llm`` item (``samples`` times each), all judges
   concurrently; an ensemble "member" is one (judge, sample) pair;
3. each ``llm`` item's score is the ``mean`` or ``median`` over members;
   its disagreement is reported as the population std and the range
   (max - min) of the member scores;
4. the rubric score is the formula of ``labrl.verifiers.rubric.scoring``;
   ``member_scores`` also gives the rubric score each member alone would
   have given, and ``disagreement`` their std and range.

Any judge failure (transport after retries, malformed answer) raises
``VerifierError`` naming the judge: one broken member fails the whole grade
rather than silently shrinking the ensemble.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict

from labrl.errors import ConfigError, CredentialsRefusedError, JudgeError, VerifierError
from labrl.verifiers.rubric.items import LLMItem, Rubric
from labrl.verifiers.rubric.judge import JudgeClient, _gather
from labrl.verifiers.rubric.scoring import rubric_score, score_deterministic

Aggregate = Literal["mean", "median"]


class ItemResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    kind: str
    polarity: str
    weight: float
    score: float
    member_scores: tuple[float, ...] = ()  # llm items: one per (judge, sample)
    std: float = 0.0
    range: float = 0.0
    rationales: tuple[str, ...] = ()


class Disagreement(BaseModel):
    model_config = ConfigDict(frozen=True)

    members: int
    score_std: float
    score_range: float
    max_item_range: float
    mean_item_std: float


class RubricResult(BaseModel):
    """The score of one response; ``items`` keeps every per-item score for analysis."""

    model_config = ConfigDict(frozen=True)

    score: float
    raw: float
    positive_weight: float
    items: tuple[ItemResult, ...]
    judges: tuple[str, ...]
    member_scores: tuple[float, ...]
    disagreement: Disagreement | None = None

    def item(self, item_id: str) -> ItemResult:
        return next(i for i in self.items if i.id == item_id)


def aggregate(values: Sequence[float], how: Aggregate) -> float:
    return statistics.fmean(values) if how == "mean" else float(statistics.median(values))


class RubricGrader:
    def __init__(self, judges: Sequence[JudgeClient] = (), aggregate: Aggregate = "mean") -> None:
        if aggregate not in ("mean", "median"):
            raise ConfigError(f"aggregate must be 'mean' or 'median', got {aggregate!r}")
        self.judges = tuple(judges)
        self.aggregate: Aggregate = aggregate

    async def aclose(self) -> None:
        for judge in self.judges:
            await judge.aclose()

    async def _judge_all(
        self, items: Sequence[LLMItem], response: str, question: str | None
    ) -> list[dict[str, list[tuple[float, str]]]]:
        async def one(judge: JudgeClient) -> dict[str, list[tuple[float, str]]]:
            try:
                return await judge.judge(items, response, question)
            except CredentialsRefusedError:  # a setup error every grade would hit: stops the run
                raise
            except JudgeError as exc:
                raise VerifierError(f"judge {judge.name!r} failed: {exc}") from exc
            except VerifierError as exc:
                raise VerifierError(f"judge {judge.name!r} gave an unusable answer: {exc}") from exc

        return await _gather([one(judge) for judge in self.judges])

    async def grade(self, rubric: Rubric, response: str, question: str | None = None) -> RubricResult:
        llm_items = rubric.llm_items
        if llm_items and not self.judges:
            raise ConfigError(
                f"rubric has {len(llm_items)} llm item(s) but the grader has no judges: pass judges=[...]"
            )
        per_judge = await self._judge_all(llm_items, response, question) if llm_items else []
        # members: one (judge, sample) pair each -> {item id: score}
        members: list[dict[str, float]] = []
        rationales: dict[str, list[str]] = {item.id: [] for item in llm_items}  # type: ignore[misc]
        for answers in per_judge:
            samples = len(next(iter(answers.values())))
            for s in range(samples):
                members.append({item_id: answers[item_id][s][0] for item_id in answers})
            for item_id, values in answers.items():
                rationales[item_id].extend(r for _, r in values)

        fixed = {
            item.id: score_deterministic(item, response)
            for item in rubric.items
            if not isinstance(item, LLMItem)
        }
        results, final = [], dict(fixed)
        for item in rubric.items:
            assert item.id is not None
            if isinstance(item, LLMItem):
                scores = [m[item.id] for m in members]
                final[item.id] = aggregate(scores, self.aggregate)
                results.append(
                    ItemResult(
                        id=item.id, kind=item.kind, polarity=item.polarity, weight=item.weight,
                        score=final[item.id], member_scores=tuple(scores), std=statistics.pstdev(scores),
                        range=max(scores) - min(scores), rationales=tuple(rationales[item.id]),
                    )
                )  # fmt: skip
            else:
                results.append(
                    ItemResult(
                        id=item.id,
                        kind=item.kind,
                        polarity=item.polarity,
                        weight=item.weight,
                        score=fixed[item.id],
                    )
                )
        score, raw = rubric_score(rubric, final)
        member_totals = tuple(rubric_score(rubric, {**fixed, **m})[0] for m in members)
        disagreement = None
        if members:
            llm_results = [r for r in results if r.kind == "llm"]
            disagreement = Disagreement(
                members=len(members),
                score_std=statistics.pstdev(member_totals),
                score_range=max(member_totals) - min(member_totals),
                max_item_range=max(r.range for r in llm_results),
                mean_item_std=statistics.fmean(r.std for r in llm_results),
            )
        return RubricResult(
            score=score, raw=raw, positive_weight=rubric.positive_weight, items=tuple(results),
            judges=tuple(j.name for j in self.judges), member_scores=member_totals, disagreement=disagreement,
        )  # fmt: skip
