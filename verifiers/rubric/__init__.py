"""labrl.verifiers.rubric: weighted rubric rewards with deterministic and LLM-judged items.

::

    from labrl.verifiers.rubric import JudgeClient, JudgeConfig, Rubric, RubricGrader

    rubric = Rubric.model_validate({"items": [
        {"text": "Names `rutile` as the stable polymorph", "weight": 2},
        {"kind": "numeric", "text": "Transition near 600 °C", "value": 600, "tolerance": 100, "units": "degC"},
        {"text": "Claims `anatase is the stable` polymorph", "polarity": "negative"},
    ]})
    grader = RubricGrader([JudgeClient(JudgeConfig(base_url="http://127.0.0.1:30000/v1", model="qwen3"))])
    result = await grader.grade(rubric, response_text, question=question_text)
    result.score, result.items, result.disagreement

See ``scoring`` for the score formula, ``prompt`` for how the response is
isolated from the judge's instructions, ``judge`` for the client (batching,
caching, retries), ``mock_judge`` for the CI judge.
"""

from labrl.verifiers.rubric.grade import Disagreement, ItemResult, RubricGrader, RubricResult
from labrl.verifiers.rubric.items import ContainsItem, LLMItem, NumericItem, RegexItem, Rubric, RubricItem
from labrl.verifiers.rubric.judge import JudgeCache, JudgeClient, JudgeConfig, default_cache
from labrl.verifiers.rubric.scoring import rubric_score, score_deterministic

__all__ = [
    "ContainsItem",
    "Disagreement",
    "ItemResult",
    "JudgeCache",
    "JudgeClient",
    "JudgeConfig",
    "LLMItem",
    "NumericItem",
    "RegexItem",
    "Rubric",
    "RubricGrader",
    "RubricItem",
    "RubricResult",
    "default_cache",
    "rubric_score",
    "score_deterministic",
]
