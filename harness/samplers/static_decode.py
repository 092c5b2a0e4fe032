"""A decode engine with static shapes, so one decode step can run as one captured CUDA graph.

``StaticDecodeEngine`` runs the megatron-core ``GPTModel`` the ``LocalSampler`` built,
reading that model's own parameters (no second copy of the weights: a weight update
copied into the model is what the next step reads, graphed or not), for a fixed
batch bucket ``B`` and cache capacity ``C``:

- KV cache per layer ``[B, G, C, D]`` (``G`` key/value groups), preallocated, keys
  stored after RoPE; a row ``b`` occupies slots ``[start_b, slot)``, prompts
  left-padded to a common length ``P`` and every row at the same slot, as in the
  megatron engine (RoPE positions are slot indices; relative positions are exact);
- attention: one ``scaled_dot_product_attention`` over the whole cache with a length
  mask ``start_b <= j <= s`` (query at slot ``s``; a padding query also sees its own
  slot, so no row is fully masked). Grouped heads are folded into the query axis,
  ``q [B, G, (H/G) * S, D]`` against ``k [B, G, C, D]``, so no kernel needs
  ``enable_gqa`` and the cache is never repeated per head;
- MoE layers: megatron's router gating (``router_gating_linear``), ``topk`` over the
  logits and ``softmax`` over the chosen ``K`` (megatron's ``softmax`` score
  function without pre-softmax), tokens sorted by expert on the device
  (``argsort``; tokens per expert by ``index_add_``, never read on the host), and
  the model's own ``TorchGroupedMLP`` (``grouped_mm``); the chosen experts are
  written into a preallocated routing buffer ``[L, B, C, K]`` at the token's slot;
- sampling on the device (``device_sampling``), into preallocated token and
  log-prob buffers; a row's ``done`` flag is kept on the device.

One decode step (``step``) samples token ``n`` of every row from the current
logits, feeds it at slot ``slot``, and leaves the next logits: no host copy, no
``.item()``, no allocation that depends on data, the slot and token index being
0-d device tensors advanced in place. The prefill (``start``: the variable prompt
length) runs eagerly. ``capture_step`` records the step once per sampling variant
as a CUDA graph where ``device.decode_graphs`` allows it, and eager otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from labrl.errors import ConfigError
from labrl.harness.models.device import HOST
from labrl.harness.samplers.device_sampling import sample_on_device, vocab_keys


def routing_dtype(num_experts: int) -> torch.dtype:
    """int16 holds any expert index below 2^15 (the routing buffer is ``[L, B, C, K]``: the largest buffer after the cache)."""
    return torch.int16 if num_experts < 2**15 else torch.int32


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest of ``sizes`` that holds ``n``; ``n`` itself beyond the largest (a shape of its own)."""
    return min((s for s in sizes if s >= n), default=n)


def capacity_bucket(needed: int, max_sequence_length: int, smallest: int = 128) -> int:
    """Cache capacity for ``needed`` slots: the next power of two from ``smallest``, capped at the context length.

    Attention reads the whole cache every step, so the capacity follows the batch's
    need; powers of two bound the number of shapes (and graphs) to ``log2`` of the context.
    """
    capacity = smallest
    while capacity < needed:
        capacity *= 2
    return min(capacity, max_sequence_length)


def capture_step(step: Callable[[], None], device: torch.device, enabled: bool) -> Callable[[], None]:
    """``step`` itself (eager), or the replay of a CUDA graph of it when ``enabled``.

    Capture runs ``step`` twice on a side stream first (lazy initialisation and the
    allocator's first blocks must happen outside the graph), then records one call; the
    engine resets its state afterwards, so these runs leave nothing behind. The capture is
    ``thread_local``: the learner trains in another thread of the same process, and the
    default (``global``) mode would fail its CUDA calls while the sampler captures.
    """
    if not enabled:
        return step
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()
    return graph.replay


class StaticDecodeEngine:
    """Batch bucket ``batch_size``, cache capacity ``capacity``; see the module docstring."""

    def __init__(self, model, *, batch_size: int, capacity: int, stop_width: int, graphs: bool) -> None:
        self.model = model
        tconfig = model.config
        check_supported(model)
        self.layers = list(model.decoder.layers)
        self.moe_layers = [i for i, layer in enumerate(self.layers) if hasattr(layer.mlp, "router")]
        self.B, self.C = batch_size, capacity
        self.heads = tconfig.num_attention_heads
        self.groups = tconfig.num_query_groups or self.heads
        self.head_dim = tconfig.kv_channels
        self.topk = tconfig.moe_router_topk
        self.num_experts = tconfig.num_moe_experts
        weight = model.embedding.word_embeddings.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.vocab = weight.shape[0]
        self.router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
            str(tconfig.moe_router_dtype), None
        )
        B, C, dev = batch_size, capacity, self.device
        emb = model.rotary_pos_emb(C).reshape(C, -1).float()  # (C, D) angles of slot positions
        self.cos_C_D, self.sin_C_D = torch.cos(emb), torch.sin(emb)
        self.key_slots = torch.arange(C, device=dev)
        self.k_cache = [
            torch.zeros(B, self.groups, C, self.head_dim, dtype=self.dtype, device=dev) for _ in self.layers
        ]
        self.v_cache = [torch.zeros_like(k) for k in self.k_cache]
        self.routed = torch.zeros(
            len(self.moe_layers), B, C, self.topk, dtype=routing_dtype(self.num_experts), device=dev
        )
        self.vocab_keys = vocab_keys(self.vocab, dev)
        # per-row settings and per-step state, all on the device
        self.start = torch.zeros(B, dtype=torch.long, device=dev)
        self.temperature = torch.zeros(B, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(B, dtype=torch.long, device=dev)
        self.top_p = torch.ones(B, dtype=torch.float32, device=dev)
        self.seed = torch.zeros(B, dtype=torch.long, device=dev)
        self.max_new = torch.ones(B, dtype=torch.long, device=dev)
        self.stop_ids = torch.full((B, stop_width), -1, dtype=torch.long, device=dev)
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)
        self.logits = torch.zeros(B, self.vocab, dtype=torch.float32, device=dev)
        self.tokens = torch.zeros(B, C, dtype=torch.long, device=dev)
        self.logprobs = torch.zeros(B, C, dtype=torch.float32, device=dev)
        self.slot = torch.zeros((), dtype=torch.long, device=dev)
        self.index = torch.zeros((), dtype=torch.long, device=dev)
        with torch.no_grad():
            self._steps = {
                truncate: capture_step(functools.partial(self._step, truncate), dev, graphs)
                for truncate in (False, True)
            }
        self.graphed = graphs
        self.reset()

    # -- host side: once per batch ---------------------------------------------

    def start_batch(
        self,
        ids_B_P: torch.Tensor,
        start_B: torch.Tensor,
        *,
        temperature_B: torch.Tensor,
        top_k_B: torch.Tensor,
        top_p_B: torch.Tensor,
        seed_B: torch.Tensor,
        max_new_B: torch.Tensor,
        stop_ids_B_S: torch.Tensor,
    ) -> None:
        """Load a batch (host tensors, ``B`` rows: the bucket's, padding rows included) and prefill it.

        ``stop_ids_B_S``: each row's stop tokens padded with -1 to the engine's ``stop_width``.
        """
        P = ids_B_P.shape[1]
        if P >= self.C:
            raise ConfigError(f"a prompt of {P} tokens leaves no room in a cache of {self.C} slots")
        if stop_ids_B_S.shape[1] != self.stop_ids.shape[1]:
            raise ConfigError(
                f"stop lists of width {stop_ids_B_S.shape[1]} given to an engine built for {self.stop_ids.shape[1]}"
            )
        self.reset()
        with torch.no_grad():
            for buffer, host in (
                (self.start, start_B),
                (self.temperature, temperature_B),
                (self.top_k, top_k_B),
                (self.top_p, top_p_B),
                (self.seed, seed_B),
                (self.max_new, max_new_B),
                (self.stop_ids, stop_ids_B_S),
            ):
                buffer.copy_(host)
            self.done.zero_()
            self.index.zero_()
            self.slot.fill_(P)
            slots = self.key_slots[:P]
            self.logits.copy_(self._forward(ids_B_P.to(self.device), slots))

    def step(self, truncate: bool) -> None:
        """One decode step (graph replay or eager); ``truncate``: some row uses top-k or top-p."""
        with torch.no_grad():
            self._steps[truncate]()

    def all_done(self) -> bool:
        """Whether every row stopped (one host sync: the caller decides how often to ask)."""
        return bool(self.done.all())

    def read_back(
        self, steps: int, prompt_len: int, *, routing: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Host copies: tokens ``(B, steps)``, log-probs ``(B, steps)``, routing ``(B, prompt_len + steps, L, K)``
        (``None`` unless ``routing``).

        Routing at slot ``s`` belongs to the token fed there: prompt slots, then output tokens 0..steps-1.
        """
        tokens = self.tokens[:, :steps].to(HOST)
        logprobs = self.logprobs[:, :steps].to(HOST)
        routed = self.routed[:, :, : prompt_len + steps].permute(1, 2, 0, 3).to(HOST) if routing else None
        return tokens, logprobs, routed

    def reset(self) -> None:
        """Zero the per-batch state (after a capture's warm-up runs)."""
        with torch.no_grad():
            for t in (self.tokens, self.logprobs, self.done, self.slot, self.index, self.routed, self.logits):
                t.zero_()

    # -- device side -------------------------------------------------------------

    def _step(self, truncate: bool) -> None:
        token, logprob = sample_on_device(
            self.logits,
            self.temperature,
            self.top_k,
            self.top_p,
            self.seed,
            self.index,
            self.vocab_keys,
            truncate=truncate,
        )
        at = self.index.view(1)
        self.tokens.index_copy_(1, at, token[:, None])
        self.logprobs.index_copy_(1, at, logprob[:, None])
        stopped = (token[:, None] == self.stop_ids).any(dim=1) | (self.index + 1 >= self.max_new)
        self.done |= stopped
        self.logits.copy_(self._forward(token[:, None], self.slot.view(1)))
        self.slot += 1
        self.index += 1

    def _forward(self, ids_B_S: torch.Tensor, slots_S: torch.Tensor) -> torch.Tensor:
        """Tokens at cache slots ``slots_S`` (every row the same) -> fp32 logits of the last one, ``(B, V)``."""
        from torch.nn.functional import embedding

        x = embedding(ids_B_S, self.model.embedding.word_embeddings.weight)  # (B, S, H)
        allowed = self._mask(slots_S)
        cos = self.cos_C_D[slots_S][None, :, None, :].to(self.dtype)  # (1, S, 1, D)
        sin = self.sin_C_D[slots_S][None, :, None, :].to(self.dtype)
        moe = 0
        for i, layer in enumerate(self.layers):
            x = x + self._attention(layer, layer.input_layernorm(x), i, slots_S, allowed, cos, sin)
            h = layer.pre_mlp_layernorm(x)
            if hasattr(layer.mlp, "router"):
                x = x + self._moe(layer.mlp, h, moe, slots_S)
                moe += 1
            else:
                x = x + layer.mlp(h)[0]
        x = self.model.decoder.final_layernorm(x[:, -1])
        return torch.nn.functional.linear(x, self._output_weight()).float()

    def _output_weight(self) -> torch.Tensor:
        if self.model.share_embeddings_and_output_weights:
            return self.model.shared_embedding_or_output_weight()
        return self.model.output_layer.weight

    def _mask(self, slots_S: torch.Tensor) -> torch.Tensor:
        """Bool ``(B, 1, (H/G) * S, C)``, True where a query may attend: ``start_b <= j <= s`` or ``j = s``."""
        keys = self.key_slots[None, None, :]
        s = slots_S[None, :, None]
        allowed = ((keys >= self.start[:, None, None]) & (keys <= s)) | (keys == s)  # (B, S, C)
        B, S, C = allowed.shape
        per_group = self.heads // self.groups
        return allowed[:, None, None].expand(B, 1, per_group, S, C).reshape(B, 1, per_group * S, C)

    def _attention(self, layer, h, i, slots_S, allowed, cos, sin) -> torch.Tensor:
        """Self-attention of ``h (B, S, H)`` against layer ``i``'s cache, after writing the new keys and values."""
        attn = layer.self_attention
        B, S, _ = h.shape
        G, D, per_group = self.groups, self.head_dim, self.heads // self.groups
        qkv = torch.nn.functional.linear(h, attn.linear_qkv.weight).view(B, S, G, (per_group + 2) * D)
        q, k, v = torch.split(qkv, [per_group * D, D, D], dim=-1)  # megatron's per-group layout
        q = q.reshape(B, S, self.heads, D)
        if attn.q_layernorm is not None:
            q, k = attn.q_layernorm(q), attn.k_layernorm(k)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        self.k_cache[i].index_copy_(2, slots_S, k.transpose(1, 2))
        self.v_cache[i].index_copy_(2, slots_S, v.transpose(1, 2))
        q = q.view(B, S, G, per_group, D).permute(0, 2, 3, 1, 4).reshape(B, G, per_group * S, D)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, self.k_cache[i], self.v_cache[i], attn_mask=allowed, scale=attn.core_attention.softmax_scale
        )  # (B, G, per_group * S, D)
        out = out.view(B, G, per_group, S, D).permute(0, 3, 1, 2, 4).reshape(B, S, self.heads * D)
        return torch.nn.functional.linear(out, attn.linear_proj.weight)

    def _moe(self, mlp, h: torch.Tensor, moe_index: int, slots_S: torch.Tensor) -> torch.Tensor:
        """Top-k routing and the experts, sorted on the device; records the chosen experts at their slots."""
        from megatron.core.transformer.moe.moe_utils import router_gating_linear

        B, S, H = h.shape
        K, E = self.topk, self.num_experts
        tokens = h.reshape(B * S, H)
        logits = router_gating_linear(tokens, mlp.router.weight, None, self.router_dtype or tokens.dtype)
        top_logits, experts = torch.topk(logits, K, dim=-1)  # (N, K)
        probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits)
        self.routed[moe_index].index_copy_(1, slots_S, experts.view(B, S, K).to(self.routed.dtype))
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, then by token: megatron's permutation
        counts = torch.zeros(E, dtype=torch.long, device=h.device).index_add_(0, flat, torch.ones_like(flat))
        out_sorted, _ = mlp.experts(tokens[order // K], counts, probs.reshape(-1)[order])
        out = torch.empty_like(out_sorted).index_copy_(0, order, out_sorted)
        return out.view(B, S, K, H).sum(dim=2).to(h.dtype)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """megatron's non-interleaved RoPE: ``t cos + rotate_half(t) sin``, ``rotate_half([a, b]) = [-b, a]``."""
    a, b = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-b, a), dim=-1) * sin


def check_supported(model) -> None:
    """What the engine does not compute: refuse it at build time rather than compute something else."""
    from labrl.harness.models.grouped_experts import TorchGroupedMLP

    c = model.config
    layer0 = model.decoder.layers[0]
    unsupported = {
        "the TransformerEngine layer spec (use the local spec: no TE, or engine=megatron)": not isinstance(
            layer0.input_layernorm, torch.nn.RMSNorm
        ),
        "experts other than TorchGroupedMLP": any(
            hasattr(layer.mlp, "experts") and not isinstance(layer.mlp.experts, TorchGroupedMLP)
            for layer in model.decoder.layers
        ),
        "tensor, pipeline or expert parallelism": c.tensor_model_parallel_size
        * c.pipeline_model_parallel_size
        * c.expert_model_parallel_size
        > 1,
        "router pre-softmax, sigmoid scores, group top-k, scaling, expert bias or capacity": bool(
            c.moe_router_pre_softmax
            or c.moe_router_score_function != "softmax"
            or c.moe_router_group_topk
            or c.moe_router_topk_scaling_factor
            or c.moe_router_enable_expert_bias
            or c.moe_expert_capacity_factor is not None
        ),
        "shared experts": bool(c.moe_shared_expert_intermediate_size),
        "biases": bool(c.add_bias_linear or c.add_qkv_bias),
    }
    named = [name for name, on in unsupported.items() if on]
    if named:
        raise ConfigError(
            f"the static decode engine does not support {'; '.join(named)}: use engine=megatron"
        )
