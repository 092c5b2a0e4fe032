"""SGLang's HTTP wire format: request payloads and response decoding.

Pure functions, no I/O, so the client (``sampler.py``) and the fake server
(``labrl/testing/fake_sglang_server.py``) share one definition of the format and tests pin it
without a network. Field names follow SGLang 0.5.23 / 0.5.15
(``GenerateReqInput`` in ``sglang/srt/managers/io_struct.py``):

request   ``{"input_ids", "rid", "sampling_params", "return_logprob",
            "logprob_start_len", "return_routed_experts", "routed_experts_start_len"}``
response  ``{"text", "output_ids", "meta_info": {"id", "finish_reason",
            "prompt_tokens", "completion_tokens", "weight_version",
            "weight_versions"?, "output_token_logprobs", "routed_experts"?}}``

Routed experts travel as base64 of raw little-endian int32 with shape
``(prompt_len + output_len - 1 - start_len, num_hidden_layers, topk)``: all
layers (dense ones included, never written by the server), no row for the
last sampled token (it was never fed back in). The learner wants
``(prompt_len + output_len, num_moe_layers, topk)``; ``to_learner_layout``
converts, padding the missing last row with experts ``0..topk-1`` like
``LocalSampler`` (the last token is never fed back: its row affects no
trained log-prob).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from labrl.errors import SamplerError
from labrl.harness.types import FinishReason, SamplingParams

# SamplingParams keys SGLang's ``SamplingParams.__init__`` accepts (the subset
# labrl may send or the fake server accepts); anything else is a TypeError
# there, answered with HTTP 400.
SGLANG_SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "n",
        "ignore_eos",
        "skip_special_tokens",
        "no_stop_trim",
        "sampling_seed",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "spaces_between_special_tokens",
    }
)


def sampling_params_payload(params: SamplingParams, *, max_new_tokens: int | None = None) -> dict[str, Any]:
    """labrl ``SamplingParams`` -> SGLang ``sampling_params`` (``seed`` is ``sampling_seed`` there)."""
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens if max_new_tokens is None else max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    return out


def generate_payload(
    *,
    rid: str,
    input_ids: Sequence[int],
    sampling_params: dict[str, Any],
    return_routed_experts: bool,
    routed_experts_start_len: int | None,
) -> dict[str, Any]:
    """The JSON body of one ``POST /generate``.

    ``logprob_start_len=-1`` asks for output-token log-probs only.
    ``routed_experts_start_len`` is sent only when not None (0.5.15 has no such
    field and would ignore it silently: the caller decides by server version).
    """
    body: dict[str, Any] = {
        "rid": rid,
        "input_ids": list(input_ids),
        "sampling_params": sampling_params,
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    if return_routed_experts:
        body["return_routed_experts"] = True
        if routed_experts_start_len is not None:
            body["routed_experts_start_len"] = routed_experts_start_len
    return body


def parse_weight_version(value: Any) -> int:
    """SGLang versions are strings (``--weight-version``, default ``"default"``); labrl's are ints.

    ``"default"`` is the weights the server was launched with: labrl version 0.
    """
    if value is None or value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise SamplerError(
            f"server weight_version {value!r} is not an integer: launch the server with "
            "--weight-version 0 (labrl serve sglang does) and update it with integer versions"
        ) from None


def parse_finish_reason(meta_info: dict[str, Any]) -> FinishReason:
    reason = meta_info.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind in ("stop", "length", "abort"):
        return kind
    raise SamplerError(f"unexpected finish_reason {reason!r} from SGLang")


@dataclass(frozen=True)
class Segment:
    """One ``/generate`` answer decoded: the tokens of one uninterrupted run."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    finish_message: str
    weight_version: int
    exact_versions: bool  # False when the server gave no spans and an update overlapped the run
    routed_rows: np.ndarray | None  # (rows, num_hidden_layers, topk) as sent


def versions_from_spans(spans: Sequence[dict[str, Any]], num_tokens: int) -> list[int]:
    """``weight_versions`` spans ``[{"version", "start", "end"}]`` (end exclusive) -> one version per token.

    The spans must tile ``[0, num_tokens)`` exactly.
    """
    out = [None] * num_tokens
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        if not 0 <= start <= end <= num_tokens:
            raise SamplerError(f"weight_versions span {span} lies outside the {num_tokens} output tokens")
        version = parse_weight_version(span["version"])
        for i in range(start, end):
            out[i] = version
    missing = [i for i, v in enumerate(out) if v is None]
    if missing:
        raise SamplerError(f"weight_versions spans leave output tokens {missing[:5]} without a version")
    return [int(v) for v in out]  # type: ignore[arg-type]


def decode_segment(
    body: dict[str, Any], *, submitted_version: int, want_routed_experts: bool, server: str
) -> Segment:
    """Decode one ``/generate`` response.

    Per-token versions: from ``weight_versions`` spans when present (0.5.23);
    otherwise every token gets ``weight_version`` if the server still had the
    version it had at submission (no update overlapped the run), else the
    older ``submitted_version`` (staleness over-, never under-estimated) and
    ``exact_versions=False``.
    """
    try:
        meta = body["meta_info"]
        output_ids = [int(t) for t in body["output_ids"]]
    except (KeyError, TypeError) as exc:
        raise SamplerError(f"{server}: /generate answer lacks {exc}: {str(body)[:200]}") from None
    finish = parse_finish_reason(meta)
    reason = meta.get("finish_reason")
    message = str(reason.get("message", "")) if isinstance(reason, dict) else ""
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise SamplerError(
            f"{server}: /generate answer has no output_token_logprobs (return_logprob ignored?)"
        )
    if len(entries) != len(output_ids):
        raise SamplerError(f"{server}: {len(entries)} output_token_logprobs for {len(output_ids)} output_ids")
    logprobs: list[float] = []
    for i, entry in enumerate(entries):
        logprob, token_id = entry[0], entry[1]
        if int(token_id) != output_ids[i]:
            raise SamplerError(
                f"{server}: logprob entry {i} is for token {token_id}, output has {output_ids[i]}"
            )
        logprobs.append(float("nan") if logprob is None else float(logprob))
    weight_version = parse_weight_version(meta.get("weight_version"))
    spans = meta.get("weight_versions")
    if spans:
        versions, exact = versions_from_spans(spans, len(output_ids)), True
    elif weight_version == submitted_version:
        versions, exact = [weight_version] * len(output_ids), True
    else:
        versions, exact = [submitted_version] * len(output_ids), False
    routed = None
    encoded = meta.get("routed_experts") if want_routed_experts else None
    if encoded is not None:
        routed = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    elif want_routed_experts and finish != "abort":
        # (An aborted run may end before its rows were gathered: the resumed
        # request asks again from the same row, so nothing is lost.)
        raise SamplerError(
            f"{server}: routed experts were requested but the answer has none: launch the server "
            "with --enable-return-routed-experts (labrl serve sglang adds it)"
        )
    return Segment(output_ids, logprobs, versions, finish, message, weight_version, exact, routed)


def encode_routed_experts(rows_T_N_K: np.ndarray) -> str:
    """The server side: int32 ``(rows, num_hidden_layers, topk)`` -> base64 of raw int32."""
    return base64.b64encode(np.ascontiguousarray(rows_T_N_K, dtype="<i4").tobytes()).decode("ascii")


def reshape_routed_rows(
    flat: np.ndarray, *, rows: int, num_hidden_layers: int, topk: int, server: str
) -> np.ndarray:
    """Flat int32 from the wire -> ``(rows, num_hidden_layers, topk)``, checking the count."""
    expected = rows * num_hidden_layers * topk
    if flat.size != expected:
        raise SamplerError(
            f"{server}: routed_experts has {flat.size} int32 values, expected {rows} rows x "
            f"{num_hidden_layers} layers x top-{topk} = {expected}: check num_hidden_layers/topk in "
            "the sampler config against the served model"
        )
    return flat.reshape(rows, num_hidden_layers, topk)


def to_learner_layout(rows_R_N_K: np.ndarray, *, num_tokens: int, moe_layers: Sequence[int]) -> np.ndarray:
    """Server rows for tokens ``[0, num_tokens - 1)`` over all layers -> ``(num_tokens, moe_layers, topk)``.

    Drops dense layers (keeps the hidden-layer indices in ``moe_layers``) and
    pads the last token's missing row with experts ``0..topk-1`` (as
    ``LocalSampler`` does: that token is never fed back, its row is replayed
    for no trained log-prob).
    """
    if rows_R_N_K.shape[0] != num_tokens - 1:
        raise SamplerError(f"routed experts have {rows_R_N_K.shape[0]} rows for {num_tokens} tokens")
    moe = rows_R_N_K[:, list(moe_layers), :]  # (T-1, L, K)
    topk = rows_R_N_K.shape[2]
    last = np.broadcast_to(np.arange(topk, dtype=np.int32), (1, len(moe_layers), topk))
    return np.concatenate([moe, last], axis=0).astype(np.int32)  # (T, L, K)
