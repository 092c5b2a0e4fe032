"""Build megatron-core GPT models with MoE layers, on CPU or GPU.

``ensure_model_parallel`` initialises torch.distributed and megatron-core's
parallel state once per process and is safe to call again (tests build many
learners and samplers in one process). A single-process run rendezvous
through a private file store, so concurrent processes never fight over a TCP
port; a multi-process launch (``torchrun``: RANK/WORLD_SIZE in the
environment) uses ``env://``.

Every choice that depends on CUDA or TransformerEngine (layer spec, grouped
GEMM, token dispatcher, process-group backend, RNG tracker, workarounds) comes
from ``labrl.harness.models.device``; the spec chosen, and why, is logged once
per process.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from typing import Literal

import torch

from labrl.errors import ConfigError
from labrl.harness.models import device as dev
from labrl.harness.models.attention import SDPAttention, mark_causal, with_core_attention
from labrl.harness.models.config import MoEModelConfig, ParallelConfig, check_parallel
from labrl.harness.models.cpu_compat import apply_workarounds

log = logging.getLogger(__name__)
_init_lock = threading.Lock()
_logged: set[str] = set()


def ensure_model_parallel(parallel: ParallelConfig, device: torch.device | str = "auto") -> None:
    """Initialise torch.distributed and megatron-core model parallelism once.

    The first call fixes the process group's backend (``device.process_group_backend``).
    """
    from megatron.core import parallel_state

    caps = dev.detect_capabilities()
    device = dev.resolve_device(str(device), caps)  # a torch.device too: "cuda" gains its ordinal
    with _init_lock:
        apply_workarounds(dev.workarounds(device, caps))
        backend = dev.process_group_backend(device)
        dev.make_current(device)  # NCCL binds this rank's communicators to the current device
        if not torch.distributed.is_initialized():
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                torch.distributed.init_process_group(backend=backend, init_method="env://")
            else:
                store_dir = tempfile.mkdtemp(prefix="labrl-dist-")
                torch.distributed.init_process_group(
                    backend=backend,
                    init_method=f"file://{store_dir}/store",
                    rank=0,
                    world_size=1,
                )
        wanted = (parallel.tensor_parallel, parallel.pipeline_parallel, parallel.expert_parallel)
        if parallel_state.model_parallel_is_initialized():
            have = (
                parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size(),
            )
            if have != wanted:
                raise ConfigError(
                    f"model parallelism already initialised as (tp, pp, ep)={have} in this process; "
                    f"requested {wanted}: use the same ParallelConfig for every model in one process"
                )
            return
        check_parallel(parallel, cuda=device.type == "cuda", world_size=torch.distributed.get_world_size())
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_parallel,
            pipeline_model_parallel_size=parallel.pipeline_parallel,
            expert_model_parallel_size=parallel.expert_parallel,
        )
        if dev.rng_tracker(device) == "cuda":
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(0)


def build_gpt_model(
    config: MoEModelConfig,
    parallel: ParallelConfig | None = None,
    *,
    seed: int = 0,
    routing_replay: bool = True,
    device: torch.device | str = "auto",
    dtype: torch.dtype = torch.float32,
    experts: dev.ExpertsRequest = "auto",
    attention: Literal["auto", "sdpa", "unfused"] = "auto",
):
    """A megatron-core ``GPTModel`` of shape ``config`` on ``device``, parameters in ``dtype``.

    Layer ``i`` carries experts when ``i % moe_layer_freq == 0`` and a dense
    SwiGLU MLP of width ``ffn_hidden_size`` otherwise (``decoder_block_spec``).
    On CPU parameters are initialised from torch's default generator; on CUDA
    on the device, from megatron's CUDA RNG tracker reseeded with ``seed`` (a
    seed therefore gives different weights on CPU and CUDA, the same ones on
    every run of either).

    Every MoE router gets its own ``RouterReplay`` (``routing_replay=True``),
    detached from megatron-core's process-wide registry: a learner and a
    sampler live in one process, and the registry's static setters would
    drive both models' routers at once. ``labrl.harness.models.routing``
    drives one model's routers.

    ``attention``: the local spec's core attention; ``auto`` is ``device.core_attention``'s
    choice, ``sdpa`` / ``unfused`` force ``SDPAttention`` / megatron's ``DotProductAttention``
    (benchmarks and equivalence tests compare the two). The TE spec keeps TE's attention.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    caps = dev.detect_capabilities()
    device = dev.resolve_device(str(device), caps)  # a torch.device too: "cuda" gains its ordinal
    parallel = parallel or ParallelConfig()
    ensure_model_parallel(parallel, device)
    choice = spec_choice(config, parallel, device, dtype, experts, caps)
    _log_once(
        f"labrl model on {device}: {choice.name} layer spec ({choice.reason}); "
        f"{choice.experts.name} experts ({choice.experts.reason}); parameters {dtype}"
    )
    tconfig = config.transformer_config(
        parallel,
        cpu=device.type != "cuda",
        routing_replay=routing_replay,
        spec=choice,
        dtype=dtype,
    )
    spec = decoder_block_spec(
        tconfig, use_transformer_engine=choice.use_transformer_engine, experts=choice.experts.name
    )
    kernel = dev.core_attention(device, caps) if attention == "auto" else attention
    if not choice.use_transformer_engine and kernel == "sdpa":
        spec = with_core_attention(spec, SDPAttention)
    _log_once(f"labrl model on {device}: core attention {kernel}")
    before = list(RouterReplay.global_router_replay_instances)
    cuda = device.type == "cuda"
    dev.make_current(device)  # megatron allocates KV caches and buffers on the current device
    fork = torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else [])
    with fork:
        torch.manual_seed(seed)
        if cuda:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)
        model = GPTModel(
            config=tconfig,
            transformer_layer_spec=spec,
            vocab_size=config.vocab_size,
            max_sequence_length=config.max_sequence_length,
            position_embedding_type="rope",
            rotary_base=config.rotary_base,
            share_embeddings_and_output_weights=config.tie_embeddings,
            parallel_output=False,
        )
    RouterReplay.global_router_replay_instances[:] = before
    return model.to(device=device, dtype=dtype)


def spec_choice(
    config: MoEModelConfig,
    parallel: ParallelConfig,
    device: torch.device,
    dtype: torch.dtype,
    experts: dev.ExpertsRequest = "auto",
    caps: dev.Capabilities | None = None,
) -> dev.SpecChoice:
    """``device.layer_spec`` for a model of this shape (whether its experts fit ``grouped_mm``'s alignment).

    Expert FFN per rank: megatron's expert tensor-parallel size defaults to the tensor-parallel size.
    """
    caps = dev.detect_capabilities() if caps is None else caps
    ffn = config.moe_ffn_hidden_size // parallel.tensor_parallel
    aligned = dev.grouped_mm_aligned(config.hidden_size, ffn, dtype)
    return dev.layer_spec(device, caps, dtype, experts, aligned=aligned)


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.warning(message) if "without TransformerEngine" in message else log.info(message)


def decoder_block_spec(tconfig, *, use_transformer_engine: bool, experts: dev.ExpertsName = "SequentialMLP"):
    """One layer spec per decoder layer, MoE or dense as ``tconfig.moe_layer_freq`` says.

    megatron-core's ``get_gpt_decoder_block_spec``
    (megatron/core/models/gpt/gpt_layer_specs.py) reads the per-layer pattern
    from the config; a single layer spec passed to ``GPTModel`` instead would
    make every layer MoE whatever the pattern. Local modules or the
    TransformerEngine ones, as ``device.layer_spec`` chose; ``experts="TorchGroupedMLP"``
    puts ``grouped_experts.TorchGroupedMLP`` where the local spec has SequentialMLP (it takes
    the same submodules).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(
        tconfig, use_transformer_engine=use_transformer_engine, normalization=tconfig.normalization
    )
    if experts == "TorchGroupedMLP":
        _use_torch_grouped_experts(spec)
    return spec


def _use_torch_grouped_experts(block_spec) -> None:
    """Swap SequentialMLP for TorchGroupedMLP in every MoE layer of ``block_spec``.

    Each level is copied (``dataclasses.replace``), not mutated: megatron-core's MoE layers
    share one spec object, which later builds must find unchanged.
    """
    from dataclasses import replace

    from megatron.core.transformer.moe.experts import SequentialMLP

    from labrl.harness.models.grouped_experts import TorchGroupedMLP

    swapped = 0
    for i, layer in enumerate(block_spec.layer_specs):
        mlp = layer.submodules.mlp
        experts = getattr(getattr(mlp, "submodules", None), "experts", None)
        if experts is None:
            continue  # a dense layer
        if experts.module is not SequentialMLP:
            raise ConfigError(
                f"TorchGroupedMLP replaces SequentialMLP, but this layer spec has {experts.module}"
            )
        grouped = replace(
            mlp, submodules=replace(mlp.submodules, experts=replace(experts, module=TorchGroupedMLP))
        )
        block_spec.layer_specs[i] = replace(layer, submodules=replace(layer.submodules, mlp=grouped))
        swapped += 1
    if swapped == 0:
        raise ConfigError("TorchGroupedMLP chosen, but the layer spec has no MoE layer")


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def causal_attention_mask(num_tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool ``[1, 1, T, T]``, True where attention is blocked (future keys).

    Always passed explicitly: megatron-core's default causal mask
    (megatron/core/transformer/utils.py: get_default_causal_mask) is built on CUDA. Marked as
    causal, so ``SDPAttention`` runs it as ``is_causal`` without reading it.
    """
    mask = torch.triu(torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device), diagonal=1)
    return mark_causal(mask[None, None])


class CausalInputs:
    """A forward's position ids ``(B, T)`` and causal mask ``[1, 1, T, T]`` for rows of T tokens, made on
    the device once, not three launches a forward (``arange``, ``ones``, ``triu``).

    Every T's are views of the largest made so far: the top-left ``T x T`` block of a causal mask is
    the causal mask of T tokens, so memory is one mask of the longest rows (T^2 bytes), rebuilt when
    longer rows come. Each T's mask view is one object, marked causal (``mark_causal``) like
    ``causal_attention_mask``'s."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._positions = torch.empty(0, dtype=torch.long, device=device)
        self._mask = torch.empty(1, 1, 0, 0, dtype=torch.bool, device=device)
        self._views: dict[int, torch.Tensor] = {}

    def __call__(self, batch_size: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        if num_tokens > self._positions.numel():
            self._positions = torch.arange(num_tokens, device=self.device)
            self._mask = causal_attention_mask(num_tokens, device=self.device)
            self._views = {}
        mask = self._views.get(num_tokens)
        if mask is None:
            mask = self._views[num_tokens] = mark_causal(self._mask[..., :num_tokens, :num_tokens])
        return self._positions[:num_tokens].expand(batch_size, num_tokens), mask
