"""Every CUDA-dependent decision of model building, as small pure functions.

Each function takes the machine's ``Capabilities`` (CUDA present, TransformerEngine
importable, the ``grouped_gemm`` package importable, torch with ``grouped_mm``) instead of probing it, so
the CPU test suite checks every (CUDA, TE) combination with the capabilities
faked; ``detect_capabilities()`` is the one place that probes.

Decisions (CUDA, TE):

=================  ======================  =====================================  ======================
                   CPU                     CUDA, no TE                            CUDA + TE
=================  ======================  =====================================  ======================
layer spec         local                   local                                  TransformerEngine
experts            TorchGroupedMLP         bf16: TorchGroupedMLP (torch           TEGroupedMLP
                   (torch grouped_mm)      grouped_mm); fp32: SequentialMLP
token dispatcher   allgather               alltoall                               alltoall
process group      gloo                    nccl                                   nccl
param dtype auto   fp32                    bf16 (fp32 under 100M parameters)      same
optimizer          AdamW on the params     AdamW on fp32 master copies (bf16)     same
RNG tracker        inference (no-op fork)  CUDA RNG states, forks locked          same
workarounds        all of cpu_compat       thread safety, ``te_general_gemm``     thread safety
core attention     SDPA                    SDPA                                   TE's
objective          eager (compiled asked)  eager (compiled asked: needs Triton)   same
=================  ======================  =====================================  ======================

"thread safety": a per-call attention scratch buffer and a lock around RNG forks
(``cpu_compat`` 1 and 7), because the learner and the sampler run in two threads.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from labrl.errors import ConfigError

# Host-side buffers (built on the CPU, then copied to the model's device once) name this device.
HOST = torch.device("cpu")

PrecisionChoice = Literal["auto", "fp32", "bf16"]
DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"

# Workarounds of labrl.harness.models.cpu_compat, by name (the names ``workarounds`` returns).
CPU_ONLY_WORKAROUNDS = (
    "rng_tracker",
    "router_gating_device",
    "kv_cache_allocation",
    "rotary_embedding",
)
NO_TE_WORKAROUNDS = ("router_gating_gemm",)
# A learner and a sampler forward at once in two threads of one process, on any device.
THREAD_SAFETY_WORKAROUNDS = ("global_memory_buffer", "rng_fork_lock")


@dataclass(frozen=True)
class Capabilities:
    cuda: bool
    transformer_engine: bool
    grouped_gemm: bool = False  # fanshiqing/grouped_gemm: megatron-core's legacy GroupedMLP without TE
    torch_grouped_mm: bool = False  # torch.nn.functional.grouped_mm (torch >= 2.10): TorchGroupedMLP
    # this process's CUDA device (``process_cuda_index``): what ``auto`` and a bare ``cuda`` mean
    cuda_index: int = 0
    triton: bool = False  # what torch.compile's inductor generates CUDA kernels with


def detect_capabilities() -> Capabilities:
    cuda = torch.cuda.is_available()
    return Capabilities(
        cuda=cuda,
        cuda_index=process_cuda_index(
            os.environ, device_count=torch.cuda.device_count(), current=torch.cuda.current_device()
        )
        if cuda
        else 0,
        transformer_engine=_importable("transformer_engine.pytorch"),
        grouped_gemm=_importable("grouped_gemm"),
        torch_grouped_mm=hasattr(torch.nn.functional, "grouped_mm"),
        triton=_importable("triton"),
    )


def launcher_value(environ: Mapping[str, str], name: str, what: str) -> int | None:
    """The launcher's ``name`` (torchrun's ``LOCAL_RANK``, ``WORLD_SIZE``) as a non-negative int,
    None when unset; anything else is a ``ConfigError`` naming ``what`` it should be."""
    raw = environ.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not {what}: unset it (torchrun sets it)") from None
    if value < 0:
        raise ConfigError(f"{name}={value} is negative: unset it (torchrun sets it)")
    return value


def process_cuda_index(environ: Mapping[str, str], *, device_count: int, current: int) -> int:
    """The CUDA device this process owns.

    Under a launcher that starts one process per GPU (``torchrun`` sets ``LOCAL_RANK``, the rank's
    index on its node) that is GPU ``LOCAL_RANK``, as megatron-core's own launcher sets it: every
    process starts with device 0 current, and ranks sharing GPU 0 would all allocate there (NCCL
    refuses two ranks on one GPU). With a single visible GPU it is that one (a launcher that binds
    each rank to its GPU with ``CUDA_VISIBLE_DEVICES``). Without ``LOCAL_RANK``: the current device.
    """
    local_rank = launcher_value(environ, "LOCAL_RANK", "a rank index")
    if local_rank is None:
        return current
    if device_count == 1:
        return 0
    if local_rank >= device_count:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but {device_count} CUDA devices are visible: launch at most one "
            "process per GPU (torchrun --nproc-per-node), or give each rank one GPU with CUDA_VISIBLE_DEVICES"
        )
    return local_rank


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def resolve_device(requested: str, caps: Capabilities) -> torch.device:
    """``auto`` -> CUDA when available, else ``cpu``; ``cuda[:N]`` without CUDA is an error.

    A CUDA device always comes back with its ordinal (``cuda`` -> ``cuda:<caps.cuda_index>``, this
    process's GPU: ``process_cuda_index``): tensors report ``cuda:0``, never ``cuda``, so an
    unindexed device compares unequal to their ``.device``, and ``torch.cuda.set_device`` refuses it
    (seen on an H100: "Expected a torch.device with a specified index").
    """
    if not re.match(DEVICE_PATTERN, requested):
        raise ConfigError(f"device={requested!r}: use auto, cpu, cuda or cuda:N")
    if requested == "auto":
        return torch.device("cuda", caps.cuda_index) if caps.cuda else torch.device("cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not caps.cuda:
        raise ConfigError(f"device={requested!r} but CUDA is not available here: use device=auto or cpu")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", caps.cuda_index)
    return device


def make_current(device: torch.device) -> None:
    """Make ``device`` the current CUDA device (a no-op off CUDA); a bare ``cuda`` keeps the current one.

    megatron-core allocates buffers, and NCCL binds its groups, on the current device, not on the
    device the model was asked for.
    """
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)


#: ``auto`` picks bf16 on CUDA only for models at least this large (total parameters)
BF16_MIN_PARAMETERS = 100_000_000


def param_dtype(precision: str, device: torch.device, *, parameters: int) -> torch.dtype:
    """``auto``: bf16 on CUDA for a model of >= ``BF16_MIN_PARAMETERS`` parameters, else fp32;
    ``fp32`` / ``bf16`` are honoured as given (``precision_reason`` says why, for the log).

    Below 100M parameters fp32 weights and Adam state take under 1.6 GB, so bf16 saves
    nothing that matters, and on the quickstart (0.6M parameters, one H100, 2026-11-26)
    bf16 learned clearly worse than fp32 (docs/gpu.md).
    """
    if precision == "auto":
        small = parameters < BF16_MIN_PARAMETERS
        return torch.float32 if device.type != "cuda" or small else torch.bfloat16
    try:
        return {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    except KeyError:
        raise ConfigError(f"precision={precision!r}: use auto, fp32 or bf16") from None


def precision_reason(precision: str, device: torch.device, *, parameters: int) -> str:
    """One line: the dtype ``param_dtype`` chose and why."""
    name = precision_name(param_dtype(precision, device, parameters=parameters))
    if precision != "auto":
        return f"{name} (as configured)"
    if device.type != "cuda":
        return f"{name} (auto: fp32 off CUDA)"
    size = f"{parameters / 1e6:.1f}M parameters"
    if name == "fp32":
        return f"{name} (auto: {size} < {BF16_MIN_PARAMETERS / 1e6:.0f}M, where bf16 saves little and learns worse)"
    return f"{name} (auto: {size} on CUDA)"


def precision_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


ExpertsName = Literal["SequentialMLP", "TorchGroupedMLP", "GroupedMLP", "TEGroupedMLP"]
ExpertsRequest = Literal["auto", "sequential", "grouped_mm"]
GROUPED_MM_ALIGN_BYTES = 16


@dataclass(frozen=True)
class ExpertsChoice:
    """Which experts module a model's MoE layers use, and why."""

    name: ExpertsName
    reason: str


def grouped_mm_aligned(hidden_size: int, ffn_per_partition: int, dtype: torch.dtype) -> bool:
    """Whether the experts' ``grouped_mm`` operands have 16-byte-aligned strides (torch requires it).

    Their row strides are ``H``, ``2F`` and ``F`` elements, ``F`` the expert FFN size per
    tensor-parallel rank: multiples of 4 in fp32, of 8 in bf16.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    return all((n * itemsize) % GROUPED_MM_ALIGN_BYTES == 0 for n in (hidden_size, ffn_per_partition))


def experts_module(
    device: torch.device,
    caps: Capabilities,
    dtype: torch.dtype,
    requested: ExpertsRequest = "auto",
    *,
    aligned: bool = True,
) -> ExpertsChoice:
    """The experts module for parameters in ``dtype`` on ``device`` (``aligned``: ``grouped_mm_aligned``).

    ``auto``: ``TorchGroupedMLP`` (``labrl.harness.models.grouped_experts``, all experts in one
    ``grouped_mm``) wherever torch has ``grouped_mm`` and the shape is aligned, except CUDA in
    fp32 and CUDA with TE. On CUDA torch runs bf16 ``grouped_mm`` as one CUTLASS kernel
    (SM90/SM100) but fp32 as a loop over the experts with a host sync, what SequentialMLP does.
    On CPU it was measured (fp32) on the quickstart's model: a learner step as fast as with
    SequentialMLP, a decode step faster (``benchmarks/experts_cpu.py``, docs/gpu.md).
    megatron's legacy ``GroupedMLP`` (the ``grouped_gemm`` package) only in bf16 where
    TorchGroupedMLP cannot run (torch < 2.10, a misaligned shape): it asserts bf16 and stores its weights under names the HF export does not map.
    ``sequential`` / ``grouped_mm`` choose the local spec's module as configured.
    """
    if requested != "auto":
        return _requested_experts(device, caps, requested, aligned)
    cuda = device.type == "cuda"
    if cuda and caps.transformer_engine:
        return ExpertsChoice("TEGroupedMLP", "TransformerEngine's grouped GEMM")
    bf16 = dtype == torch.bfloat16
    if caps.torch_grouped_mm and aligned and (bf16 or not cuda):
        where = "bf16 on CUDA" if cuda else "CPU: as fast in a learner step, faster in decode, docs/gpu.md"
        return ExpertsChoice("TorchGroupedMLP", f"all experts in one torch grouped_mm ({where})")
    if cuda and bf16 and caps.grouped_gemm:
        return ExpertsChoice("GroupedMLP", "grouped GEMM from the grouped_gemm package (bf16)")
    if not caps.torch_grouped_mm:
        why = "torch without grouped_mm (< 2.10)"
    elif not aligned:
        why = "hidden or expert FFN size not a multiple of 16 bytes, as grouped_mm needs"
    else:
        why = f"{precision_name(dtype)} on CUDA: torch's grouped_mm kernel is bf16"
    return ExpertsChoice("SequentialMLP", f"one expert after another ({why})")


def _requested_experts(
    device: torch.device, caps: Capabilities, requested: str, aligned: bool
) -> ExpertsChoice:
    if device.type == "cuda" and caps.transformer_engine:
        raise ConfigError(
            f"experts={requested!r}: with TransformerEngine the experts are TEGroupedMLP; use experts=auto"
        )
    if requested == "sequential":
        return ExpertsChoice("SequentialMLP", "as configured")
    if requested != "grouped_mm":
        raise ConfigError(f"experts={requested!r}: use auto, sequential or grouped_mm")
    if not caps.torch_grouped_mm:
        raise ConfigError("experts='grouped_mm' needs torch >= 2.10 (torch.nn.functional.grouped_mm)")
    if not aligned:
        raise ConfigError(
            "experts='grouped_mm': hidden and expert FFN sizes must be multiples of 16 bytes "
            "(grouped_mm's stride alignment); use experts=auto or sequential"
        )
    return ExpertsChoice("TorchGroupedMLP", "as configured")


@dataclass(frozen=True)
class SpecChoice:
    """Which megatron-core layer spec and MoE kernels a model on ``device`` uses, and why."""

    use_transformer_engine: bool
    moe_grouped_gemm: bool
    token_dispatcher: Literal["allgather", "alltoall"]
    reason: str
    experts: ExpertsChoice = ExpertsChoice("SequentialMLP", "default")

    @property
    def name(self) -> str:
        return "transformer_engine" if self.use_transformer_engine else "local"


def layer_spec(
    device: torch.device,
    caps: Capabilities,
    dtype: torch.dtype = torch.float32,
    experts: ExpertsRequest = "auto",
    *,
    aligned: bool = True,
) -> SpecChoice:
    """Layer spec, dispatcher and experts module (``experts_module``) for ``dtype`` parameters on ``device``.

    ``moe_grouped_gemm`` is megatron-core's flag (TEGroupedMLP or GroupedMLP in its spec);
    ``TorchGroupedMLP`` replaces SequentialMLP in the local spec (``build.decoder_block_spec``).
    """
    experts_choice = experts_module(device, caps, dtype, experts, aligned=aligned)
    if device.type != "cuda":
        return SpecChoice(
            False,
            False,
            "allgather",
            "CPU: local spec; TransformerEngine kernels need CUDA, and the alltoall dispatcher "
            "creates a CUDA stream",
            experts_choice,
        )
    if caps.transformer_engine:
        return SpecChoice(True, True, "alltoall", "CUDA with TransformerEngine: TE spec", experts_choice)
    return SpecChoice(
        False,
        experts_choice.name == "GroupedMLP",
        "alltoall",
        "CUDA without TransformerEngine (pip install labrl[te] for the TE spec): local spec",
        experts_choice,
    )


def process_group_backend(device: torch.device) -> Literal["gloo", "nccl"]:
    return "nccl" if device.type == "cuda" else "gloo"


def rng_tracker(device: torch.device) -> Literal["cuda", "inference"]:
    """``cuda``: megatron's CUDA RNG states (``model_parallel_cuda_manual_seed``); ``inference``: no-op fork."""
    return "cuda" if device.type == "cuda" else "inference"


def optimizer_wrapper(dtype: torch.dtype) -> Literal["plain", "fp32_master"]:
    """``fp32_master``: AdamW steps fp32 copies of low-precision parameters (``FP32MasterParams``)."""
    return "plain" if dtype == torch.float32 else "fp32_master"


def adamw_kernel(device: torch.device) -> Literal["fused", "default"]:
    """How AdamW runs over parameters on ``device``.

    ``fused`` (CUDA): torch's single-kernel AdamW, one launch for every parameter
    instead of one per parameter and op, and no intermediate tensors. ``default``
    (CPU): torch's own choice, what the CPU's measured runs (the quickstart's seeds)
    used; a CPU step has no launch cost for fusion to save.
    """
    return "fused" if device.type == "cuda" else "default"


def workarounds(device: torch.device, caps: Capabilities) -> tuple[str, ...]:
    """Names of the ``cpu_compat`` patches a model on ``device`` needs."""
    no_te = () if caps.transformer_engine else NO_TE_WORKAROUNDS
    if device.type == "cuda":
        return THREAD_SAFETY_WORKAROUNDS + no_te
    return (*THREAD_SAFETY_WORKAROUNDS, *CPU_ONLY_WORKAROUNDS, *no_te)


CoreAttention = Literal["transformer_engine", "sdpa", "unfused"]


def core_attention(device: torch.device, caps: Capabilities) -> CoreAttention:
    """The attention kernel of a model on ``device`` (``labrl.harness.models.attention``).

    ``transformer_engine``: the TE spec's own attention; ``sdpa``: the local spec with
    ``SDPAttention`` (one ``scaled_dot_product_attention`` call: flash / memory-efficient kernels
    on CUDA, the fused kernel on CPU); ``unfused``: megatron's ``DotProductAttention``
    (``baddbmm`` + softmax + ``bmm`` over the whole score matrix). SDPA on the CPU too: it was
    not slower there on the quickstart's model or on a larger shape (docs/gpu.md, "Attention").
    """
    if layer_spec(device, caps).use_transformer_engine:
        return "transformer_engine"
    return "sdpa"


ObjectiveKernel = Literal["eager", "compiled"]


def objective_kernel(
    requested: ObjectiveKernel, device: torch.device, caps: Capabilities
) -> tuple[bool, str]:
    """Whether the learner runs the per-micro-batch objective compiled (``objectives.compiled_loss_terms``),
    and why; a ``ConfigError`` where ``compiled`` cannot run.

    ``eager`` is the default on every device. Compiled, the objective is a few fused kernels where
    eager launches ~40 forward and ~12 backward a micro-batch, but each call pays dynamo's guards and
    AOTAutograd's wrappers instead: on the CPU that costs as much host time as the eager launches
    save under the default objective, and the fused CPU kernels are slower than eager's
    (``benchmarks/compiled_objective.py``, docs/gpu.md "The objective, compiled"); on CUDA it is not
    yet measured, so it is not chosen there either until a GPU says it is faster. On CUDA inductor
    generates Triton kernels, so ``compiled`` needs Triton importable.
    """
    if requested == "eager":
        return False, "eager"
    if device.type == "cuda" and not caps.triton:
        raise ConfigError(
            "learner.objective_kernel: compiled needs Triton on CUDA (torch.compile's inductor generates "
            "Triton kernels there), and triton is not importable: install it or set objective_kernel: eager"
        )
    return True, "compiled (learner.objective_kernel: compiled)"


def sdpa_native_gqa(device: torch.device, dtype: torch.dtype, explicit_mask: bool) -> bool:
    """Whether ``SDPAttention`` hands grouped key/value heads to SDPA as they are (``enable_gqa``)
    instead of repeating them to one per query head first (what megatron does).

    CPU: always; measured on 2 cores with 32 query heads on 4 groups of 128, a decode step against
    576 cached keys took 19-36 ms instead of 385-758 ms (the repetition copies the whole cache), a
    causal T=1024 step 573 instead of 740 ms, a masked prefill the same within noise. CUDA: only
    where the kernel that will run takes grouped heads, flash attention, which runs in bf16/fp16
    without a mask tensor; with a mask tensor, or in fp32, CUDA picks the memory-efficient kernel,
    which does not take ``enable_gqa`` (SDPA would fall back to its unfused math path).
    """
    if device.type != "cuda":
        return True
    return dtype in (torch.bfloat16, torch.float16) and not explicit_mask


def decode_graphs(
    device: torch.device, caps: Capabilities, dtype: torch.dtype, *, disabled: bool
) -> tuple[bool, str]:
    """Whether the static decode engine (``samplers.static_decode``) captures its decode step as CUDA graphs, and why.

    Only on CUDA, in bf16, unless the config disables it: a graph replays device work only, so
    the step must never wait on the host, and torch's fp32 ``grouped_mm`` on CUDA is a loop over
    the experts that reads the group sizes on the host (``experts_module``), which capture refuses.
    Eager everywhere else: the same step, launched op by op.
    """
    if disabled:
        return False, "eager (cuda_graphs: false)"
    if device.type != "cuda" or not caps.cuda:
        return False, "eager (CUDA graphs need CUDA)"
    if dtype != torch.bfloat16:
        return False, f"eager ({precision_name(dtype)} grouped_mm on CUDA syncs the host; graphs need bf16)"
    return True, "CUDA graphs (bf16 on CUDA)"
