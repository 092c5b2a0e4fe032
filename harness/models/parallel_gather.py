"""Gather tensor- and expert-parallel shards of megatron-core weights into the TP=1/EP=1 state dict.

A pure function over per-rank state dicts, so the weight export
(``hf_export.megatron_to_hf``) never sees a shard under a full name. Rank
``(t, e)`` holds tensor-parallel rank ``t`` of expert-parallel rank ``e``;
dense (non-expert) weights are identical across ``e`` and taken from
``e = 0``. megatron-core's sharding rules (local spec, no biases)::

    embedding.word_embeddings.weight   vocab-parallel      cat dim 0
    output_layer.weight                column-parallel     cat dim 0
    self_attention.linear_qkv.weight   column-parallel     cat dim 0 (rank t holds query groups
                                                           [t*G/tp, (t+1)*G/tp), each [q.., k, v])
    self_attention.linear_proj.weight  row-parallel        cat dim 1
    mlp.linear_fc1.weight (gated)      column-parallel     rank t holds [gate_t; up_t]:
                                                           gate = cat(gate_t), up = cat(up_t)
    mlp.linear_fc2.weight              row-parallel        cat dim 1
    ...local_experts.j.*               expert-parallel     rank e holds experts
                                                           [e*E/ep, (e+1)*E/ep) as j = 0..E/ep-1,
                                                           each sharded over the expert-TP ranks
                                                           like the dense MLP
    norms, q/k layernorm, router       replicated          taken from rank (0, 0)

``expert_tp`` is megatron's ``expert_tensor_parallel_size`` (it defaults to
the tensor-parallel size); with ``expert_tp=1`` experts are whole on every
tensor-parallel rank and are taken from ``t = 0``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from labrl.errors import ConfigError

Shards = Mapping[tuple[int, int], Mapping[str, torch.Tensor]]

_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_COLUMN = ("embedding.word_embeddings.weight", "output_layer.weight", "self_attention.linear_qkv.weight")
_ROW = ("self_attention.linear_proj.weight", "linear_fc2.weight")
_GATED = ("linear_fc1.weight",)


def is_expert_weight(name: str) -> bool:
    """Whether ``name`` is a local expert's weight (sharded over expert-parallel ranks)."""
    return _EXPERT.match(name) is not None


def _merge(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """One parameter's tensor-parallel pieces (rank order) -> the whole tensor."""
    if len(parts) == 1:
        return parts[0]
    if name.endswith(_COLUMN):
        return torch.cat(parts, dim=0)
    if name.endswith(_ROW):
        return torch.cat(parts, dim=1)
    if name.endswith(_GATED):
        halves = [p.chunk(2, dim=0) for p in parts]  # each rank: [gate_t; up_t]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    first = parts[0]
    if any(p.shape != first.shape or not torch.equal(p, first) for p in parts[1:]):
        raise ConfigError(f"{name!r} differs across tensor-parallel ranks but is not a known sharded weight")
    return first


def gather_model_parallel_shards(
    shards: Shards, *, tp: int, ep: int, num_experts: int, expert_tp: int | None = None
) -> dict[str, torch.Tensor]:
    """Per-rank megatron state dicts ``{(tp_rank, ep_rank): state}`` -> the unsharded state dict."""
    expert_tp = tp if expert_tp is None else expert_tp
    want = {(t, e) for t in range(tp) for e in range(ep)}
    if set(shards) != want:
        raise ConfigError(f"shards cover ranks {sorted(shards)}, expected every (tp, ep) in {sorted(want)}")
    if num_experts % ep:
        raise ConfigError(f"num_experts={num_experts} is not divisible by expert parallel size {ep}")
    if tp % expert_tp:
        raise ConfigError(f"tensor parallel size {tp} is not a multiple of expert_tp={expert_tp}")
    local = num_experts // ep
    out: dict[str, torch.Tensor] = {}
    for name in shards[(0, 0)]:
        if name.endswith("_extra_state"):
            continue
        m = _EXPERT.match(name)
        if m is None:
            out[name] = _merge(name, [shards[(t, 0)][name] for t in range(tp)])
            continue
        head, j, tail = m.group(1), int(m.group(2)), m.group(3)
        if j >= local:
            raise ConfigError(f"{name!r}: local expert {j} but each EP rank holds {local} experts")
        for e in range(ep):
            parts = [shards[(t, e)][name] for t in range(expert_tp)]
            out[f"{head}{e * local + j}{tail}"] = _merge(name, parts)
    return out
