"""Workarounds that let megatron-core 0.16.1 run a GPTModel with MoE layers on CPU, or without TE,
and run a learner and a sampler in two threads of one process.

megatron-core assumes CUDA (and TransformerEngine) in a handful of places, and one model per
process. Each workaround below names the upstream spot it covers;
``labrl.harness.models.device.workarounds`` decides which ones a model needs
(all of them on CPU; on CUDA the two thread-safety ones, 1 and 7, plus 3 without
TransformerEngine) and ``apply_workarounds`` installs them, each once per process.

1. ``megatron/core/utils.py: GlobalMemoryBuffer.get_tensor`` hands out one
   process-wide scratch buffer (used by the local ``DotProductAttention`` for
   ``baddbmm``) on ``torch.cuda.current_device()``. Replaced by a fresh
   allocation per call, on the CPU without CUDA, else on the current CUDA
   device: the learner and the sampler run forward passes in different
   threads, and on one buffer one thread's softmax could read the other's
   attention scores (on CUDA both threads' kernels share the default stream,
   so nothing would fail: the scores would silently be wrong).
2. ``megatron/core/tensor_parallel/random.py: CudaRNGStatesTracker.fork``
   swaps CUDA RNG states around dropout. On CPU the tracker is re-created as
   megatron's own inference tracker, whose ``fork`` is a no-op context (the
   presets use dropout 0, so no RNG stream is lost).
3. ``megatron/core/transformer/moe/moe_utils.py: RouterGatingLinearFunction``
   tests ``te_general_gemm is not None``, a name only bound when
   TransformerEngine imports: NameError without it. Bound to None so the
   plain ``torch.mm`` path runs.
4. ``megatron/core/transformer/moe/router.py: Router.gating`` moves CPU
   weights to ``torch.cuda.current_device()`` on every call. Replaced by the
   same computation without the move.
5. ``megatron/core/transformer/attention.py: Attention._allocate_memory``
   (static-batching KV cache) allocates on ``torch.cuda.current_device()``.
   Replaced by a CPU allocation of the same shape.
6. ``megatron/core/models/common/embeddings/rotary_pos_embedding.py:
   RotaryEmbedding.get_emb`` moves ``inv_freq`` to
   ``torch.cuda.current_device()`` on first use. Replaced by the same
   computation on the buffer's own device.
7. ``CudaRNGStatesTracker.fork`` (the CUDA tracker, with its RNG states) keeps
   the name of the state in force on the tracker and swaps the process-wide
   CUDA RNG state: a learner step and a sampler forward forking at once in two
   threads raised "current state name default-rng is not the same as the
   desired state name model-parallel-rng" (seen on an H100, quickstart step
   16). Each fork now holds one process-wide re-entrant lock, so forks (a
   dropout call each) take turns.

The MoE token dispatcher ``alltoall`` creates a CUDA stream in ``__init__``:
that one is a config choice (``allgather`` on CPU), enforced by
``labrl.harness.models.config.MoEModelConfig.transformer_config``.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_lock = threading.Lock()


_applied: set[str] = set()


def apply_workarounds(names: tuple[str, ...]) -> tuple[str, ...]:
    """Install the named workarounds (each once per process); returns the names now active."""
    unknown = set(names) - set(PATCHES)
    if unknown:
        raise ValueError(f"unknown workarounds {sorted(unknown)}; known: {sorted(PATCHES)}")
    with _lock:
        for name in names:
            if name not in _applied:
                PATCHES[name]()
                _applied.add(name)
        return tuple(sorted(_applied))


def apply_cpu_workarounds() -> bool:
    """Install the workarounds a CPU model needs; returns True when they are active (no CUDA)."""
    from labrl.harness.models.device import detect_capabilities, workarounds

    caps = detect_capabilities()
    if caps.cuda:
        return False
    apply_workarounds(workarounds(torch.device("cpu"), caps))
    return True


def _patch_global_memory_buffer() -> None:
    from megatron.core import utils

    device = torch.cuda.current_device if torch.cuda.is_available() else lambda: "cpu"

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):  # type: ignore[no-untyped-def]
        return torch.empty(tuple(tensor_shape), dtype=dtype, device=device(), requires_grad=False)

    utils.GlobalMemoryBuffer.get_tensor = get_tensor


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random

    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


_RNG_FORK_LOCK = threading.RLock()  # re-entrant: a fork inside a fork, in one thread, is megatron's own use


def _patch_rng_fork_lock() -> None:
    from megatron.core.tensor_parallel import random

    fork = random.CudaRNGStatesTracker.fork

    @contextlib.contextmanager
    def locked_fork(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        with _RNG_FORK_LOCK, fork(self, *args, **kwargs):
            yield

    locked_fork.__wrapped__ = fork  # megatron's own, for the test that reproduces the race
    random.CudaRNGStatesTracker.fork = locked_fork


def _patch_router_gating_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_router_gating_device() -> None:
    from megatron.core.transformer.moe import router

    def gating(self, input: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        router_dtype = input.dtype
        if self.config.moe_router_dtype == "fp32":
            router_dtype = torch.float32
        elif self.config.moe_router_dtype == "fp64":
            router_dtype = torch.float64
        return router.router_gating_linear(input, self.weight, self.bias, router_dtype)

    router.Router.gating = gating


def _patch_kv_cache_allocation() -> None:
    from megatron.core.transformer import attention

    def _allocate_memory(self, inference_max_sequence_length, batch_size, dim, dtype):  # type: ignore[no-untyped-def]
        return torch.empty(
            inference_max_sequence_length,
            batch_size,
            self.num_query_groups_per_partition,
            dim,
            dtype=dtype,
            device="cpu",
        )

    attention.Attention._allocate_memory = _allocate_memory


def _patch_rotary_embedding() -> None:
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:  # type: ignore[no-untyped-def]
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]  # (S, 1, 1, dim)

    rotary_pos_embedding.RotaryEmbedding.get_emb = get_emb


PATCHES = {
    "global_memory_buffer": _patch_global_memory_buffer,
    "rng_tracker": _patch_rng_tracker,
    "rng_fork_lock": _patch_rng_fork_lock,
    "router_gating_gemm": _patch_router_gating_gemm,
    "router_gating_device": _patch_router_gating_device,
    "kv_cache_allocation": _patch_kv_cache_allocation,
    "rotary_embedding": _patch_rotary_embedding,
}
