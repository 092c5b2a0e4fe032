"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` (SDPA), for the local spec.

``SDPAttention`` is a drop-in ``core_attention`` for megatron-core's ``SelfAttention``: it keeps
the contract of megatron's unfused ``DotProductAttention``
(megatron/core/transformer/dot_product_attention.py, 0.16) and computes the same function, but
in one SDPA call instead of ``baddbmm`` + masked softmax + ``bmm`` over a materialised
``[b, heads, sq, sk]`` score matrix, so CUDA runs a flash or memory-efficient kernel and the CPU
its fused kernel.

For one head, with query ``q_i``, keys ``k_j``, values ``v_j`` and scale ``c``::

    out_i = sum_j softmax_j(c * q_i . k_j + m_ij) v_j,   m_ij = 0 (allowed) or -10000 (blocked)

- scale ``c``: the ``softmax_scale`` given (``config.softmax_scale``), else ``1/sqrt(head_dim)``.
  ``apply_query_key_layer_scaling`` changes nothing here: megatron divides the scores by the layer
  number and multiplies them back inside its fp32 softmax, a net scale of ``c``.
- masks: a bool mask is True where attention is blocked (megatron's convention). megatron
  *replaces* blocked scores with -10000; adding -10000 gives the same probabilities (the blocked
  terms underflow to exactly 0 in fp32) whenever a row has an allowed key. A row with every key
  blocked (a left-padding position of the sampler's prefill) is uniform under megatron: its output
  is the mean of the values; here such a row gets a zero query and no blocked key, so its scores
  are equal and the softmax is the same uniform one (and, as there, no gradient reaches its query
  or the keys). The additive mask is finite, so no SDPA backend meets a row of -inf (NaN, in
  forward or backward).
- causal: a mask from ``causal_attention_mask`` (the learner's), or no mask with a causal mask
  type, runs as ``is_causal=True``: no mask tensor is read, and CUDA can use flash attention.
- GQA: the ``num_query_groups`` key/value heads serve ``heads / groups`` query heads each, head
  ``h`` using group ``h // (heads / groups)``: SDPA's own ``enable_gqa`` where
  ``device.sdpa_native_gqa`` says the kernel takes it, else repeated first as megatron does.
- dropout on the attention probabilities only in training (``attention_dropout``), under
  megatron's model-parallel RNG fork like ``DotProductAttention``'s.

Not supported, as by ``DotProductAttention``: context parallelism, packed sequences, attention
bias; and, refused here instead of computed: sliding windows and off-by-one / learnable softmax.
"""

from __future__ import annotations

import dataclasses
import math
import weakref

import torch
from torch import Tensor

from labrl.errors import ConfigError

# megatron-core's value for blocked scores (megatron/core/transformer/utils.py: attention_mask_func)
BLOCKED_SCORE = -10000.0

# Masks made by ``mark_causal``, by id; an entry dies with its mask, so a reused id never matches.
_causal_masks: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()


def mark_causal(mask: Tensor) -> Tensor:
    """Record that ``mask`` (bool ``[1, 1, T, T]``, True above the diagonal) is the plain causal mask.

    Reading the mask's values to find out would synchronise with the GPU in every layer; the
    builder of the mask knows it.
    """
    _causal_masks[id(mask)] = mask
    return mask


def is_marked_causal(mask: Tensor | None) -> bool:
    return mask is not None and _causal_masks.get(id(mask)) is mask


# The last mask prepared, for the next layers of the same forward (every layer gets the same mask
# object): (mask, its in-place version counter, dtype, fully blocked rows, additive mask).
_last_prepared: tuple[weakref.ref[Tensor], int, torch.dtype, Tensor, Tensor] | None = None


def _prepared_mask(blocked: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(rows with every key blocked ``[.., sq, 1]``, the additive mask in ``dtype``) of a bool mask.

    Made once per forward rather than once per layer: on a decode step the preparation's few small
    kernels cost about as much as the attention itself. The cached entry is checked by identity and
    version counter, so a new or modified mask is always prepared afresh.
    """
    global _last_prepared
    last = _last_prepared
    if last is not None and last[0]() is blocked and last[1] == blocked._version and last[2] == dtype:
        return last[3], last[4]
    fully_blocked = blocked.all(dim=-1, keepdim=True)
    additive = (blocked & ~fully_blocked).to(dtype).mul_(BLOCKED_SCORE)
    _last_prepared = (weakref.ref(blocked), blocked._version, dtype, fully_blocked, additive)
    return fully_blocked, additive


class SDPAttention(torch.nn.Module):
    """megatron-core core attention computed by SDPA; see the module docstring for the rules."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.utils import is_layer_window_attention

        super().__init__()
        if config.context_parallel_size != 1:
            raise ConfigError("SDPAttention: context parallelism needs TransformerEngine's attention")
        if config.softmax_type != "vanilla":
            raise ConfigError(f"SDPAttention: softmax_type={config.softmax_type!r} is not supported")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ConfigError("SDPAttention: sliding-window attention is not supported")
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type=None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
    ) -> Tensor:
        """``query [sq, b, heads, d]``, ``key``/``value [sk, b, groups, d]`` -> ``[sq, b, heads * d]``."""
        from megatron.core.transformer.enums import AttnMaskType

        from labrl.harness.models.device import sdpa_native_gqa

        if packed_seq_params is not None or attention_bias is not None:
            raise ConfigError("SDPAttention: packed sequences and attention bias need TransformerEngine")
        sq, b = query.shape[:2]
        sk = key.shape[0]
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = is_marked_causal(attention_mask) or (
            attention_mask is None and mask_type == AttnMaskType.causal and sq > 1
        )
        if causal and sq != sk:
            raise ConfigError(f"SDPAttention: a causal mask needs as many queries as keys, got {sq} and {sk}")
        explicit = None if causal else attention_mask
        native_gqa = self.groups != self.heads and sdpa_native_gqa(
            query.device, query.dtype, explicit is not None
        )
        if self.groups != self.heads and not native_gqa:
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        additive = None
        if explicit is not None:
            # a row with every key blocked is uniform under megatron: the mean of the values. A zero
            # query with its keys unblocked gives that here too (equal scores), and no gradient to
            # its query or to the keys. Unblocked, not all shifted by BLOCKED_SCORE: backward passes
            # recompute probabilities from a log-sum-exp, which near -1e4 keeps only ~1e-3 in fp32.
            fully_blocked, additive = _prepared_mask(explicit, query.dtype)
            query = query.masked_fill(fully_blocked.permute(2, 0, 1, 3), 0.0)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        dropout_p = self.dropout_p if self.training else 0.0

        def attend() -> Tensor:
            return torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=additive,
                dropout_p=dropout_p,
                is_causal=causal,
                scale=self.softmax_scale,
                enable_gqa=native_gqa,
            )

        if dropout_p > 0 and not self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = attend()
        else:
            out = attend()
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)


def with_core_attention(block_spec, core_attention: type):
    """``block_spec`` (megatron's ``TransformerBlockSubmodules``) with every layer's core attention replaced.

    Copies instead of assigning in place: the layers share one spec object, and megatron's spec
    builders may hand out module-level ones.
    """

    def layer(spec):
        attention = spec.submodules.self_attention
        attention = dataclasses.replace(
            attention,
            submodules=dataclasses.replace(attention.submodules, core_attention=core_attention),
        )
        return dataclasses.replace(
            spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention)
        )

    return dataclasses.replace(block_spec, layer_specs=[layer(s) for s in block_spec.layer_specs])
