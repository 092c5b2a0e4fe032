"""Host side of the static decode engine: a batch's shape, its host tensors, and each row's end.

Once per batch (never per step): ``static_shape`` picks the engine's batch bucket,
cache capacity and stop-list width, ``pack`` lays the requests out as the host
tensors ``StaticDecodeEngine.start_batch`` copies up, and after the last step
``row_end`` finds where each row stopped in the tokens read back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from labrl.harness.models.device import HOST
from labrl.harness.samplers.static_decode import bucket, capacity_bucket
from labrl.harness.types import GenerateRequest


@dataclass(frozen=True)
class StaticShape:
    """``batch``, ``capacity``, ``stop_width``: the engine's (graph) shape; ``prompt``, ``steps``: this batch's."""

    batch: int
    capacity: int
    stop_width: int
    prompt: int
    steps: int


def static_shape(
    requests: Sequence[GenerateRequest], max_new: Sequence[int], buckets: tuple[int, ...], max_len: int
) -> StaticShape:
    """Bucketed shape for ``requests`` (each with room for ``max_new`` tokens, all >= 1).

    The stop-list width is a power of two, so few widths (and graphs) occur.
    """
    prompt = max(len(r.input_ids) for r in requests)
    steps = max(max_new)
    widest = max(len(r.sampling.stop_token_ids) for r in requests)
    stop_width = 1
    while stop_width < widest:
        stop_width *= 2
    return StaticShape(
        batch=bucket(len(requests), buckets),
        capacity=capacity_bucket(prompt + steps, max_len),
        stop_width=stop_width,
        prompt=prompt,
        steps=steps,
    )


def pack(
    requests: Sequence[GenerateRequest],
    max_new: Sequence[int],
    seeds: Sequence[int],
    shape: StaticShape,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """Host tensors for ``start_batch``: prompts left-padded to ``shape.prompt``; rows past the requests
    are padding (one greedy token from their last slot, never read)."""
    B, P = shape.batch, shape.prompt
    ids = torch.full((B, P), pad_token_id, dtype=torch.long, device=HOST)
    start = torch.full((B,), P - 1, dtype=torch.long, device=HOST)
    temperature = torch.zeros(B, dtype=torch.float32, device=HOST)
    top_k = torch.zeros(B, dtype=torch.long, device=HOST)
    top_p = torch.ones(B, dtype=torch.float32, device=HOST)
    seed = torch.zeros(B, dtype=torch.long, device=HOST)
    steps = torch.ones(B, dtype=torch.long, device=HOST)
    stop = torch.full((B, shape.stop_width), -1, dtype=torch.long, device=HOST)
    for b, (r, n, s) in enumerate(zip(requests, max_new, seeds, strict=True)):
        prompt = r.input_ids
        ids[b, P - len(prompt) :] = torch.tensor(prompt, dtype=torch.long, device=HOST)
        start[b] = P - len(prompt)
        temperature[b] = r.sampling.temperature
        top_k[b] = r.sampling.top_k
        top_p[b] = r.sampling.top_p
        seed[b] = s
        steps[b] = n
        stops = r.sampling.stop_token_ids
        if stops:
            stop[b, : len(stops)] = torch.tensor(stops, dtype=torch.long, device=HOST)
    return {
        "ids_B_P": ids,
        "start_B": start,
        "temperature_B": temperature,
        "top_k_B": top_k,
        "top_p_B": top_p,
        "seed_B": seed,
        "max_new_B": steps,
        "stop_ids_B_S": stop,
    }


def needs_truncation(requests: Sequence[GenerateRequest]) -> bool:
    """Whether a sampled row uses top-k or top-p (the engine's step variant with a sort over the vocabulary)."""
    return any(
        r.sampling.temperature > 0 and (r.sampling.top_k > 0 or r.sampling.top_p < 1.0) for r in requests
    )


def row_end(tokens: Sequence[int], max_new: int, stop_token_ids: Sequence[int]) -> tuple[int, str]:
    """``(tokens kept, finish reason)``: through the first stop token, else ``max_new`` (``length``)."""
    for i, token in enumerate(tokens[:max_new]):
        if token in stop_token_ids:
            return i + 1, "stop"
    return min(max_new, len(tokens)), "length"
