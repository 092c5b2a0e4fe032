"""Every CUDA-dependent decision, for each (CUDA, TransformerEngine) combination, capabilities faked."""

from __future__ import annotations

import pytest
import torch

from labrl.errors import ConfigError
from labrl.harness.models import device as dev
from labrl.harness.models.cpu_compat import PATCHES

CPU = dev.Capabilities(cuda=False, transformer_engine=False)
CPU_TE = dev.Capabilities(cuda=False, transformer_engine=True)
CUDA = dev.Capabilities(cuda=True, transformer_engine=False)
CUDA_GG = dev.Capabilities(cuda=True, transformer_engine=False, grouped_gemm=True)
CUDA_TE = dev.Capabilities(cuda=True, transformer_engine=True)
ALL = [CPU, CPU_TE, CUDA, CUDA_GG, CUDA_TE]
# torch >= 2.10 has torch.nn.functional.grouped_mm; the capabilities above are an older torch's
GMM = dict(torch_grouped_mm=True)
CPU_GMM = dev.Capabilities(cuda=False, transformer_engine=False, **GMM)
CUDA_GMM = dev.Capabilities(cuda=True, transformer_engine=False, **GMM)
CUDA_GMM_GG = dev.Capabilities(cuda=True, transformer_engine=False, grouped_gemm=True, **GMM)
CUDA_GMM_TE = dev.Capabilities(cuda=True, transformer_engine=True, **GMM)
FP32, BF16 = torch.float32, torch.bfloat16


def on(caps: dev.Capabilities) -> torch.device:
    return dev.resolve_device("auto", caps)


@pytest.mark.parametrize(
    ("caps", "want"), [(CPU, "cpu"), (CPU_TE, "cpu"), (CUDA, "cuda:0"), (CUDA_TE, "cuda:0")]
)
def test_auto_device_is_cuda_when_available(caps, want):
    assert on(caps) == torch.device(want)
    assert dev.resolve_device("cpu", caps) == torch.device("cpu")


def test_a_cuda_device_always_carries_its_ordinal():
    """Tensors on CUDA report ``cuda:N``; a bare ``cuda`` would compare unequal to their device, and
    ``torch.cuda.set_device`` refuses it (first seen on an H100)."""
    on_gpu_2 = dev.Capabilities(cuda=True, transformer_engine=False, cuda_index=2)
    assert dev.resolve_device("auto", on_gpu_2) == torch.device("cuda", 2)
    assert dev.resolve_device("cuda", on_gpu_2) == torch.device("cuda", 2)
    assert dev.resolve_device("cuda:1", on_gpu_2) == torch.device("cuda", 1)
    assert dev.resolve_device(str(torch.device("cuda")), on_gpu_2).index == 2


def test_each_torchrun_rank_owns_the_gpu_of_its_local_rank():
    """Every process starts with GPU 0 current: under torchrun ranks would all land there."""
    index = dev.process_cuda_index
    assert index({}, device_count=8, current=3) == 3  # no launcher: the current device
    assert [index({"LOCAL_RANK": str(r)}, device_count=4, current=0) for r in range(4)] == [0, 1, 2, 3]
    # a launcher binding each rank to one GPU (CUDA_VISIBLE_DEVICES) leaves one visible: that one
    assert index({"LOCAL_RANK": "5"}, device_count=1, current=0) == 0
    for bad, match in (("4", "4 CUDA devices are visible"), ("-1", "negative"), ("one", "not a rank")):
        with pytest.raises(ConfigError, match=match):
            index({"LOCAL_RANK": bad}, device_count=4, current=0)


def test_detect_capabilities_reads_local_rank(monkeypatch):
    """The probe hands the launcher's rank to ``process_cuda_index``: ``auto`` is then that GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "2")
    caps = dev.detect_capabilities()
    assert caps.cuda_index == 2
    assert on(caps) == dev.resolve_device("cuda", caps) == torch.device("cuda", 2)
    monkeypatch.delenv("LOCAL_RANK")
    assert dev.detect_capabilities().cuda_index == 0


def test_make_current_sets_only_an_indexed_cuda_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    dev.make_current(torch.device("cpu"))
    dev.make_current(torch.device("cuda"))  # the current device stays current
    dev.make_current(torch.device("cuda", 1))
    assert calls == [1]


def test_explicit_cuda_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match="CUDA is not available"):
        dev.resolve_device("cuda:1", CPU)
    assert dev.resolve_device("cuda:1", CUDA) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="auto, cpu, cuda or cuda:N"):
        dev.resolve_device("gpu", CUDA)


@pytest.mark.parametrize(
    ("caps", "te", "grouped", "dispatcher"),
    [
        (CPU, False, False, "allgather"),
        (CPU_TE, False, False, "allgather"),  # TE kernels need CUDA: local spec on CPU even with TE
        (CUDA, False, False, "alltoall"),
        (CUDA_GG, False, True, "alltoall"),
        (CUDA_TE, True, True, "alltoall"),
    ],
)
def test_layer_spec_for_each_combination(caps, te, grouped, dispatcher):
    choice = dev.layer_spec(on(caps), caps, torch.bfloat16)  # megatron's GroupedMLP asserts bf16
    assert (choice.use_transformer_engine, choice.moe_grouped_gemm, choice.token_dispatcher) == (
        te,
        grouped,
        dispatcher,
    )
    assert choice.name == ("transformer_engine" if te else "local")
    if caps.cuda and not caps.transformer_engine:
        assert "without TransformerEngine" in choice.reason and "labrl[te]" in choice.reason


@pytest.mark.parametrize(
    ("caps", "dtype", "aligned", "want"),
    [
        # CPU: grouped_mm wherever torch has it (measured not slower, docs/gpu.md), in either dtype
        (CPU_GMM, FP32, True, "TorchGroupedMLP"),
        (CPU_GMM, BF16, True, "TorchGroupedMLP"),
        (CPU_GMM, FP32, False, "SequentialMLP"),  # strides not 16-byte aligned
        (CPU, FP32, True, "SequentialMLP"),  # torch < 2.10
        # CUDA without TE: grouped_mm's kernel is bf16; fp32 would loop over the experts anyway
        (CUDA_GMM, BF16, True, "TorchGroupedMLP"),
        (CUDA_GMM, FP32, True, "SequentialMLP"),
        (CUDA_GMM, BF16, False, "SequentialMLP"),
        (CUDA_GMM_GG, BF16, True, "TorchGroupedMLP"),  # before megatron's legacy GroupedMLP
        (CUDA_GMM_GG, BF16, False, "GroupedMLP"),
        (CUDA_GG, BF16, True, "GroupedMLP"),  # torch < 2.10 with the grouped_gemm package
        (CUDA_GG, FP32, True, "SequentialMLP"),  # GroupedMLP asserts bf16
        (CUDA, BF16, True, "SequentialMLP"),
        # TE: TEGroupedMLP whatever torch has
        (CUDA_TE, BF16, True, "TEGroupedMLP"),
        (CUDA_GMM_TE, BF16, True, "TEGroupedMLP"),
        (CUDA_GMM_TE, FP32, True, "TEGroupedMLP"),
    ],
)
def test_experts_module_for_each_combination(caps, dtype, aligned, want):
    choice = dev.experts_module(on(caps), caps, dtype, aligned=aligned)
    assert choice.name == want
    spec = dev.layer_spec(on(caps), caps, dtype, aligned=aligned)
    assert spec.experts == choice
    # megatron's own flag builds its grouped modules; TorchGroupedMLP replaces SequentialMLP's spec entry
    assert spec.moe_grouped_gemm == (want in ("GroupedMLP", "TEGroupedMLP"))
    if want == "SequentialMLP" and caps.cuda:
        assert "one expert after another (" in choice.reason


def test_requested_experts_module():
    assert dev.experts_module(on(CUDA_GMM), CUDA_GMM, BF16, "sequential").name == "SequentialMLP"
    assert dev.experts_module(on(CUDA_GMM), CUDA_GMM, FP32, "grouped_mm").name == "TorchGroupedMLP"
    assert dev.experts_module(on(CPU_GMM), CPU_GMM, FP32, "sequential").name == "SequentialMLP"
    with pytest.raises(ConfigError, match=r"needs torch >= 2\.10"):
        dev.experts_module(on(CUDA), CUDA, BF16, "grouped_mm")
    with pytest.raises(ConfigError, match="with TransformerEngine the experts are TEGroupedMLP"):
        dev.experts_module(on(CUDA_GMM_TE), CUDA_GMM_TE, BF16, "sequential")
    with pytest.raises(ConfigError, match="multiples of 16 bytes"):
        dev.experts_module(on(CPU_GMM), CPU_GMM, FP32, "grouped_mm", aligned=False)
    with pytest.raises(ConfigError, match="use auto, sequential or grouped_mm"):
        dev.experts_module(on(CPU_GMM), CPU_GMM, FP32, "fused")


def test_this_torch_has_grouped_mm():
    """torch 2.13 here: the CPU test suite runs TorchGroupedMLP (as the quickstart does)."""
    assert dev.detect_capabilities().torch_grouped_mm == hasattr(torch.nn.functional, "grouped_mm")
    assert dev.detect_capabilities().torch_grouped_mm


@pytest.mark.parametrize(
    ("caps", "want"),
    [
        (CPU, "sdpa"),  # measured not slower than megatron's unfused attention on 2 cores (docs/gpu.md)
        (CPU_TE, "sdpa"),
        (CUDA, "sdpa"),
        (CUDA_GG, "sdpa"),
        (CUDA_TE, "transformer_engine"),  # the TE spec brings its own fused attention
    ],
)
def test_core_attention_for_each_combination(caps, want):
    assert dev.core_attention(on(caps), caps) == want


@pytest.mark.parametrize(
    ("device", "dtype", "explicit_mask", "native"),
    [
        ("cuda:0", torch.bfloat16, False, True),  # flash attention takes grouped heads
        ("cuda:0", torch.float16, False, True),
        ("cuda:0", torch.bfloat16, True, False),  # a mask tensor: memory-efficient kernel, heads repeated
        ("cuda:0", torch.float32, False, False),  # no flash in fp32
        ("cpu", torch.float32, False, True),  # CPU: measured faster (decode 20x) or equal
        ("cpu", torch.bfloat16, True, True),
    ],
)
def test_sdpa_takes_grouped_heads_on_cpu_and_into_cuda_flash_attention(device, dtype, explicit_mask, native):
    assert dev.sdpa_native_gqa(torch.device(device), dtype, explicit_mask) is native


@pytest.mark.parametrize("caps", ALL)
def test_backend_rng_and_dtypes(caps):
    device = on(caps)
    assert dev.process_group_backend(device) == ("nccl" if caps.cuda else "gloo")
    assert dev.rng_tracker(device) == ("cuda" if caps.cuda else "inference")
    big = dev.BF16_MIN_PARAMETERS
    auto = dev.param_dtype("auto", device, parameters=big)
    assert auto == (torch.bfloat16 if caps.cuda else torch.float32)  # CPU stays fp32
    assert dev.param_dtype("auto", device, parameters=big - 1) == torch.float32  # small: fp32 everywhere
    assert dev.param_dtype("fp32", device, parameters=big) == torch.float32
    assert dev.param_dtype("bf16", device, parameters=1) == torch.bfloat16
    assert dev.optimizer_wrapper(auto) == ("fp32_master" if caps.cuda else "plain")


def test_optimizer_wrapper_follows_the_dtype():
    assert dev.optimizer_wrapper(torch.float32) == "plain"
    assert dev.optimizer_wrapper(torch.bfloat16) == "fp32_master"
    with pytest.raises(ConfigError, match="precision='fp16'"):
        dev.param_dtype("fp16", torch.device("cpu"), parameters=1)


@pytest.mark.parametrize(
    ("caps", "want"),
    [
        (
            CPU,
            set(dev.CPU_ONLY_WORKAROUNDS) | {"global_memory_buffer", "rng_fork_lock", "router_gating_gemm"},
        ),
        (CPU_TE, set(dev.CPU_ONLY_WORKAROUNDS) | {"global_memory_buffer", "rng_fork_lock"}),
        # te_general_gemm is unbound without TE on CUDA too; the learner and the sampler share a
        # process on every device, so the thread-safety pair applies everywhere
        (CUDA, {"global_memory_buffer", "rng_fork_lock", "router_gating_gemm"}),
        (CUDA_GG, {"global_memory_buffer", "rng_fork_lock", "router_gating_gemm"}),
        (CUDA_TE, {"global_memory_buffer", "rng_fork_lock"}),
    ],
)
def test_workarounds_for_each_combination(caps, want):
    names = dev.workarounds(on(caps), caps)
    assert set(names) == want
    assert set(names) <= set(PATCHES)  # every name has a patch


def test_transformer_config_follows_the_spec_choice():
    from labrl.harness.models import ParallelConfig, get_preset

    tiny = get_preset("tiny-moe")
    cuda_te = dev.layer_spec(torch.device("cuda"), CUDA_TE)
    tc = tiny.transformer_config(ParallelConfig(), cpu=False, spec=cuda_te, dtype=torch.bfloat16)
    assert tc.moe_grouped_gemm and tc.moe_token_dispatcher_type == "alltoall"
    assert tc.bf16 and tc.params_dtype == torch.bfloat16
    assert not tc.use_cpu_initialization
    tc = tiny.transformer_config(ParallelConfig(), cpu=True)
    assert not tc.moe_grouped_gemm and tc.moe_token_dispatcher_type == "allgather"
    assert not tc.bf16 and tc.params_dtype == torch.float32 and tc.use_cpu_initialization


def test_detect_capabilities_matches_this_machine():
    caps = dev.detect_capabilities()
    assert caps.cuda == torch.cuda.is_available()
    try:
        import transformer_engine.pytorch  # noqa: F401

        have_te = True
    except ImportError:
        have_te = False
    assert caps.transformer_engine == have_te


def test_te_notice_is_filtered_only_without_cuda():
    from labrl._warnings import SAYS_WHY_TE_IS_MISSING, expected_warnings

    assert any(f[0] == SAYS_WHY_TE_IS_MISSING for f in expected_warnings(cuda=False))
    assert not any(f[0] == SAYS_WHY_TE_IS_MISSING for f in expected_warnings(cuda=True))


def test_a_build_logs_its_spec_choice_once(caplog, monkeypatch):
    import logging

    from labrl.harness.models import build

    monkeypatch.setattr(build, "_logged", set())
    small = get_preset_small()
    with caplog.at_level(logging.INFO, logger="labrl"):
        build.build_gpt_model(small, seed=0)
        build.build_gpt_model(small, seed=1)
    lines = [r.getMessage() for r in caplog.records if "layer spec" in r.getMessage()]
    assert len(lines) == 1
    assert "on cpu: local layer spec (CPU: local spec" in lines[0] and "torch.float32" in lines[0]
    assert "TorchGroupedMLP experts (all experts in one torch grouped_mm (CPU" in lines[0]


def get_preset_small():
    from labrl.harness.models import get_preset

    return get_preset("tiny-moe").model_copy(update={"num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64,
                                                     "moe_ffn_hidden_size": 32})  # fmt: skip


def test_rng_forks_in_two_threads_take_turns(monkeypatch):
    """megatron's CUDA RNG tracker keeps the state in force on itself; a learner step and a sampler
    forward forking at once (two threads) raised "current state name default-rng is not the same as
    the desired state name model-parallel-rng" on an H100. The CUDA RNG state is faked here."""
    import contextlib
    import threading
    import time

    from megatron.core.tensor_parallel import random as mrandom

    from labrl.harness.models.cpu_compat import apply_workarounds

    cuda_state = {"value": torch.zeros(1)}
    monkeypatch.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: cuda_state["value"].clone())
    monkeypatch.setattr(mrandom, "_set_cuda_rng_state", lambda s, *a, **k: cuda_state.update(value=s.clone()))

    def race(tracker) -> list[BaseException]:
        errors: list[BaseException] = []
        inside = threading.Barrier(2, timeout=0.5)
        entered = []

        def fork_once():
            try:
                with tracker.fork():
                    entered.append(threading.get_ident())
                    # both threads inside a fork at once, if nothing stops them (with the lock the
                    # barrier times out instead)
                    with contextlib.suppress(threading.BrokenBarrierError):
                        inside.wait()
                    if entered[0] != threading.get_ident():
                        time.sleep(0.05)  # the first one in leaves first: the order that fails
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=fork_once) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return errors

    def fresh_tracker():
        tracker = mrandom.CudaRNGStatesTracker()
        tracker.states_[mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME] = torch.ones(1)
        return tracker

    apply_workarounds(("rng_fork_lock",))
    assert race(fresh_tracker()) == []

    class Unlocked(mrandom.CudaRNGStatesTracker):  # megatron's own fork, as shipped
        fork = mrandom.CudaRNGStatesTracker.fork.__wrapped__

    unlocked = Unlocked()
    unlocked.states_[mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME] = torch.ones(1)
    assert any("is not the same as the desired state name" in str(e) for e in race(unlocked))


def test_the_precision_reason_says_why():
    cuda, cpu = torch.device("cuda:0"), torch.device("cpu")
    small = dev.precision_reason("auto", cuda, parameters=568_032)
    assert small.startswith("fp32 (auto: 0.6M parameters < 100M") and "learns worse" in small
    assert (
        dev.precision_reason("auto", cuda, parameters=3 * 10**10)
        == "bf16 (auto: 30000.0M parameters on CUDA)"
    )
    assert dev.precision_reason("auto", cpu, parameters=3 * 10**10) == "fp32 (auto: fp32 off CUDA)"
    assert dev.precision_reason("bf16", cpu, parameters=1) == "bf16 (as configured)"


@pytest.mark.parametrize(
    "caps, dtype, disabled, want",
    [
        (CPU_GMM, FP32, False, False),
        (CPU_GMM, BF16, False, False),
        (CUDA_GMM, BF16, False, True),
        (CUDA_GMM, BF16, True, False),  # cuda_graphs: false
        (CUDA_GMM, FP32, False, False),  # fp32 grouped_mm on CUDA reads group sizes on the host
        (CUDA_GMM_TE, BF16, False, True),
    ],
)
def test_decode_graphs_for_each_combination(caps, dtype, disabled, want):
    graphs, reason = dev.decode_graphs(on(caps), caps, dtype, disabled=disabled)
    assert graphs is want
    assert reason.startswith("CUDA graphs" if want else "eager")


def test_capture_is_eager_without_cuda_graphs():
    from labrl.harness.samplers.static_decode import capture_step

    calls = []

    def step() -> None:
        calls.append(1)

    assert capture_step(step, torch.device("cpu"), enabled=False) is step
    assert calls == []  # no warm-up runs when nothing is captured


def test_adamw_is_fused_on_cuda_only():
    assert dev.adamw_kernel(torch.device("cuda")) == "fused"
    assert dev.adamw_kernel(torch.device("cuda:1")) == "fused"
    assert dev.adamw_kernel(torch.device("cpu")) == "default"  # CPU runs keep their ops


@pytest.mark.parametrize("kernel", ["fused", "default"])
def test_adamw_with_precision_builds_the_kernel_the_decision_names(monkeypatch, kernel):
    from labrl.harness.learners.precision import adamw_with_precision

    seen = []
    monkeypatch.setattr(dev, "adamw_kernel", lambda device: seen.append(device) or kernel)
    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.nn.Parameter(torch.ones(4, dtype=dtype))]
        opt, master = adamw_with_precision(params, lr=0.1)
        assert bool(opt.defaults.get("fused")) == (kernel == "fused")
        stepped = master.master_params if master is not None else params
        stepped[0].grad = torch.ones(4)
        opt.step()  # torch's fused CPU kernel stands in for CUDA's: the same arguments are accepted
        assert float(stepped[0].detach()[0]) == pytest.approx(1 - 0.1 * (1 + 0.01), abs=1e-3)
    assert seen == [torch.device("cpu")] * 2


CUDA_TRITON = dev.Capabilities(cuda=True, transformer_engine=False, triton=True, **GMM)


@pytest.mark.parametrize(
    "requested, caps, device, want",
    [
        ("eager", CPU_GMM, "cpu", False),
        ("eager", CUDA_TRITON, "cuda", False),  # the default until a GPU measures compiled faster
        ("compiled", CPU_GMM, "cpu", True),  # inductor's C++ kernels
        ("compiled", CUDA_TRITON, "cuda", True),
        ("compiled", CUDA_GMM, "cpu", True),  # learner.device: cpu on a GPU node without Triton
    ],
)
def test_objective_kernel_for_each_combination(requested, caps, device, want):
    compiled, reason = dev.objective_kernel(requested, torch.device(device), caps)
    assert compiled is want and reason.startswith(requested)


def test_a_compiled_objective_on_cuda_without_triton_is_a_config_error():
    with pytest.raises(ConfigError, match="objective_kernel: compiled needs Triton on CUDA"):
        dev.objective_kernel("compiled", torch.device("cuda"), CUDA_GMM)


def test_triton_capability_matches_this_machine():
    import importlib.util

    assert dev.detect_capabilities().triton == (importlib.util.find_spec("triton") is not None)
