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


def on(caps: dev.Capabilities) -> torch.device:
    return dev.resolve_device("auto", caps)


@pytest.mark.parametrize(("caps", "want"), [(CPU, "cpu"), (CPU_TE, "cpu"), (CUDA, "cuda"), (CUDA_TE, "cuda")])
def test_auto_device_is_cuda_when_available(caps, want):
    assert on(caps) == torch.device(want)
    assert dev.resolve_device("cpu", caps) == torch.device("cpu")


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
    choice = dev.layer_spec(on(caps), caps)
    assert (choice.use_transformer_engine, choice.moe_grouped_gemm, choice.token_dispatcher) == (
        te,
        grouped,
        dispatcher,
    )
    assert choice.name == ("transformer_engine" if te else "local")
    if caps.cuda and not caps.transformer_engine:
        assert "without TransformerEngine" in choice.reason and "labrl[te]" in choice.reason


@pytest.mark.parametrize("caps", ALL)
def test_backend_rng_and_dtypes(caps):
    device = on(caps)
    assert dev.process_group_backend(device) == ("nccl" if caps.cuda else "gloo")
    assert dev.rng_tracker(device) == ("cuda" if caps.cuda else "inference")
    auto = dev.param_dtype("auto", device)
    assert auto == (torch.bfloat16 if caps.cuda else torch.float32)  # CPU stays fp32
    assert dev.param_dtype("fp32", device) == torch.float32
    assert dev.param_dtype("bf16", device) == torch.bfloat16
    assert dev.optimizer_wrapper(auto) == ("fp32_master" if caps.cuda else "plain")


def test_optimizer_wrapper_follows_the_dtype():
    assert dev.optimizer_wrapper(torch.float32) == "plain"
    assert dev.optimizer_wrapper(torch.bfloat16) == "fp32_master"
    with pytest.raises(ConfigError, match="precision='fp16'"):
        dev.param_dtype("fp16", torch.device("cpu"))


@pytest.mark.parametrize(
    ("caps", "want"),
    [
        (CPU, set(dev.CPU_ONLY_WORKAROUNDS) | {"router_gating_gemm"}),
        (CPU_TE, set(dev.CPU_ONLY_WORKAROUNDS)),
        (CUDA, {"router_gating_gemm"}),  # te_general_gemm is unbound without TE on CUDA too
        (CUDA_GG, {"router_gating_gemm"}),
        (CUDA_TE, set()),
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


def get_preset_small():
    from labrl.harness.models import get_preset

    return get_preset("tiny-moe").model_copy(update={"num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64,
                                                     "moe_ffn_hidden_size": 32})  # fmt: skip
