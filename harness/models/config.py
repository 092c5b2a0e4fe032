"""Typed model configs: the shape of a GPT model with mixture-of-experts layers.

A preset names a shape (``tiny-moe`` for CPU runs and tests, the shapes of
real MoE families for GPU runs); ``ParallelConfig`` carries the TP/EP/PP sizes
that megatron-core's ``initialize_model_parallel`` receives unchanged.
``MoEModelConfig.transformer_config()`` is the single place that turns our
config into megatron-core's ``TransformerConfig``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from labrl.errors import ConfigError

Precision = Literal["fp32", "bf16"]


class ParallelConfig(BaseModel):
    """Model-parallel sizes passed through to megatron-core."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tensor_parallel: int = Field(default=1, ge=1)
    pipeline_parallel: int = Field(default=1, ge=1)
    expert_parallel: int = Field(default=1, ge=1)


def check_parallel(parallel: ParallelConfig, *, cuda: bool, world_size: int) -> None:
    """Model parallelism must fit the hardware and the process group megatron-core splits.

    Any size > 1 needs CUDA (megatron-core's parallel layers and the alltoall
    dispatcher do), and megatron-core's ``initialize_model_parallel`` splits the
    world into groups: ``world_size % (TP * PP) == 0`` for the dense layers and
    ``world_size % (TP * EP * PP) == 0`` for the experts (expert-tensor size = TP).
    """
    tp, pp, ep = parallel.tensor_parallel, parallel.pipeline_parallel, parallel.expert_parallel
    if (tp, pp, ep) == (1, 1, 1):
        return
    if not cuda:
        raise ConfigError(
            f"model parallelism (tensor_parallel={tp}, pipeline_parallel={pp}, expert_parallel={ep}) needs CUDA: "
            "on CPU set tensor_parallel, pipeline_parallel and expert_parallel to 1 (parallel.* in a run config)"
        )
    for name, size in (
        ("tensor_parallel * pipeline_parallel", tp * pp),
        ("tensor_parallel * expert_parallel * pipeline_parallel", tp * ep * pp),
    ):
        if world_size % size:
            raise ConfigError(
                f"world size {world_size} is not a multiple of {name} = {size}: launch the learner with "
                f"torchrun --nproc-per-node a multiple of {size}, or lower the parallel.* sizes"
            )


class MoEModelConfig(BaseModel):
    """A decoder-only GPT with RoPE, RMSNorm, SwiGLU and top-k routed experts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=8)
    num_attention_heads: int = Field(ge=1)
    num_query_groups: int | None = Field(default=None, ge=1, description="None = multi-head attention")
    kv_channels: int | None = Field(default=None, ge=1, description="head dim; None = hidden/heads")
    ffn_hidden_size: int = Field(ge=1, description="dense MLP width (layers that are not MoE)")
    num_experts: int = Field(ge=2)
    moe_router_topk: int = Field(ge=1)
    moe_ffn_hidden_size: int = Field(ge=1)
    moe_layer_freq: int = Field(default=1, ge=1, description="every n-th layer is MoE (1 = all)")
    moe_aux_loss_coeff: float = Field(default=0.0, ge=0.0)
    qk_layernorm: bool = False
    vocab_size: int = Field(ge=2)
    max_sequence_length: int = Field(ge=8)
    rotary_base: int = Field(default=10000, ge=1)
    init_method_std: float = Field(default=0.02, gt=0)
    tie_embeddings: bool = False

    @model_validator(mode="after")
    def _check(self) -> MoEModelConfig:
        if self.moe_router_topk > self.num_experts:
            raise ValueError(
                f"moe_router_topk={self.moe_router_topk} exceeds num_experts={self.num_experts}: lower moe_router_topk"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}: set kv_channels or change the head count"
            )
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by num_query_groups="
                f"{self.num_query_groups}"
            )
        return self

    @property
    def moe_layer_indices(self) -> list[int]:
        """0-based indices of the layers that carry a router."""
        return [i for i in range(self.num_layers) if i % self.moe_layer_freq == 0]

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_indices)

    @property
    def parameter_count(self) -> int:
        """Total parameters of the model this config builds (every expert counted), no biases::

        head = kv_channels or hidden / heads,  groups = num_query_groups or heads
        attention = hidden * head * (2 * heads + 2 * groups)          (Q, O; K, V)
        norms     = 2 * hidden (+ 2 * head with qk_layernorm)          per layer
        MLP       = 3 * hidden * ffn                                   dense layer (SwiGLU)
                  = experts * 3 * hidden * moe_ffn + hidden * experts  MoE layer (+ router)
        total     = layers * attention + norms + MLPs + vocab * hidden * (1 if tied else 2) + hidden
        """
        h = self.hidden_size
        head = self.kv_channels or h // self.num_attention_heads
        groups = self.num_query_groups or self.num_attention_heads
        attention = h * head * (2 * self.num_attention_heads + 2 * groups)
        norms = 2 * h + (2 * head if self.qk_layernorm else 0)
        moe = self.num_experts * 3 * h * self.moe_ffn_hidden_size + h * self.num_experts
        dense = 3 * h * self.ffn_hidden_size
        mlps = self.num_moe_layers * moe + (self.num_layers - self.num_moe_layers) * dense
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attention + norms) + mlps + embeddings + h

    @property
    def active_matmul_parameter_count(self) -> int:
        """Parameters each token multiplies through: attention, the top-k experts and router, the
        output layer (not the embedding); ``6 x`` this is a token's training FLOPs besides attention::

            attention = hidden * head * (heads + 2 * groups) + heads * head * hidden   (Q, K, V; O)
            MoE layer = topk * 3 * hidden * moe_ffn + hidden * experts;  dense layer = 3 * hidden * ffn
            total     = sum over layers (attention + MLP) + hidden * vocab
        """
        h = self.hidden_size
        head = self.kv_channels or h // self.num_attention_heads
        groups = self.num_query_groups or self.num_attention_heads
        attention = h * head * (self.num_attention_heads + 2 * groups) + self.num_attention_heads * head * h
        moe = self.moe_router_topk * 3 * h * self.moe_ffn_hidden_size + h * self.num_experts
        dense = 3 * h * self.ffn_hidden_size
        mlps = self.num_moe_layers * moe + (self.num_layers - self.num_moe_layers) * dense
        return self.num_layers * attention + mlps + h * self.vocab_size

    def transformer_config(
        self,
        parallel: ParallelConfig,
        *,
        cpu: bool,
        routing_replay: bool = True,
        spec=None,
        dtype: torch.dtype = torch.float32,
    ):
        """megatron-core ``TransformerConfig`` for this shape.

                ``spec`` (a ``labrl.harness.models.device.SpecChoice``; by default the
                one for CPU or for CUDA without TransformerEngine) sets the token
                dispatcher and grouped GEMM: on CPU ``allgather``, since ``alltoall``
                creates a CUDA stream in its ``__init__``
                (megatron/core/transformer/moe/token_dispatcher.py). ``cpu`` also
                initialises parameters on the CPU. ``dtype`` bf16 sets megatron's
                ``bf16``/``params_dtype`` (the router computes in the parameters' dtype,
        as the bf16 sampler always has; router replay removes the routing
        mismatch that causes). Router fusion
                stays off: the fused top-k kernel bypasses RouterReplay.
        """
        from megatron.core.transformer.transformer_config import TransformerConfig

        if cpu:
            check_parallel(parallel, cuda=False, world_size=1)
        from labrl.harness.models import device as dev

        if spec is None:
            spec = dev.layer_spec(
                torch.device("cpu" if cpu else "cuda"),
                dev.Capabilities(cuda=not cpu, transformer_engine=False),
            )
        layer_freq: int | list[int] = (
            1
            if self.moe_layer_freq == 1
            else [int(i in self.moe_layer_indices) for i in range(self.num_layers)]
        )
        return TransformerConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.kv_channels,
            ffn_hidden_size=self.ffn_hidden_size,
            num_moe_experts=self.num_experts,
            moe_router_topk=self.moe_router_topk,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            moe_layer_freq=layer_freq,
            moe_aux_loss_coeff=self.moe_aux_loss_coeff,
            moe_router_load_balancing_type="aux_loss" if self.moe_aux_loss_coeff > 0 else "none",
            moe_token_dispatcher_type=spec.token_dispatcher,
            moe_grouped_gemm=spec.moe_grouped_gemm,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            moe_router_fusion=False,
            moe_enable_routing_replay=routing_replay,
            qk_layernorm=self.qk_layernorm,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            init_method_std=self.init_method_std,
            tensor_model_parallel_size=parallel.tensor_parallel,
            pipeline_model_parallel_size=parallel.pipeline_parallel,
            expert_model_parallel_size=parallel.expert_parallel,
            sequence_parallel=parallel.tensor_parallel > 1,
            use_cpu_initialization=cpu,
            masked_softmax_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
            attention_softmax_in_fp32=True,
        )


PRESETS: dict[str, MoEModelConfig] = {
    # Trains on 2 CPU cores: ~2.4M parameters; vocab = 256 bytes + 8 specials
    # of labrl.harness.tokenizer.ByteTokenizer.
    "tiny-moe": MoEModelConfig(
        name="tiny-moe",
        num_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        ffn_hidden_size=256,
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=256,
        vocab_size=264,
        max_sequence_length=2048,
    ),
    # Shapes of real MoE families (GPU); weights come from a local checkpoint.
    "qwen3-30b-a3b": MoEModelConfig(
        name="qwen3-30b-a3b",
        num_layers=48,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=4,
        kv_channels=128,
        ffn_hidden_size=6144,
        num_experts=128,
        moe_router_topk=8,
        moe_ffn_hidden_size=768,
        qk_layernorm=True,
        vocab_size=151936,
        max_sequence_length=40960,
        rotary_base=1000000,
        moe_aux_loss_coeff=0.001,
    ),
    "mixtral-8x7b": MoEModelConfig(
        name="mixtral-8x7b",
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=14336,
        vocab_size=32000,
        max_sequence_length=32768,
        rotary_base=1000000,
        moe_aux_loss_coeff=0.02,
    ),
}


def get_preset(name: str) -> MoEModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}") from None
