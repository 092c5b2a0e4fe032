"""The objective's device metrics: ``MetricSums`` equal to their formulas in a fixed number of launches,
``DeviceMetrics`` additive, ``nonfinite`` equal to ``~isfinite``, and no host read where none is due."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from labrl.harness.objectives import (
    M2PO,
    TIS,
    DeviceMetrics,
    MetricSums,
    ObjectiveConfig,
    ObjectiveInputs,
    batch_terms,
    m2po_mask,
    nonfinite,
    policy_loss,
    prepare,
    sum_metrics,
)
from labrl.harness.objectives._diagnostics import RATIO_QUANTILES, behaviour_diagnostics


class Launches(TorchDispatchMode):
    """Non-view aten ops dispatched while active (each a kernel on CUDA), and host reads among them:
    a scalar read, an output sized by the values, or indexing by a bool mask (a ``nonzero`` inside)."""

    READS = frozenset({"_local_scalar_dense", "nonzero", "masked_select"})

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view:
            self.ops += 1
            indices = args[1] if name.startswith("index") and isinstance(args[1], list | tuple) else ()
            by_mask = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
            self.reads += name in self.READS or by_mask
        return func(*args, **(kwargs or {}))


class ToList(TorchFunctionMode):
    """``Tensor.tolist`` calls: a device-to-host copy on CUDA that the CPU dispatcher does not show."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.Tensor.tolist
        return func(*args, **(kwargs or {}))


def _random_tokens(seed: int = 0, B: int = 5, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.3
    values = torch.randn(B, T, generator=g)
    values[~mask] = torch.tensor([math.inf, -math.inf, math.nan]).repeat(B * T)[: int((~mask).sum())]
    flags = torch.rand(B, T, generator=g) > 0.5
    return mask, values, flags


def test_metric_sums_equal_their_formulas():
    mask, values, flags = _random_tokens()
    n = int(mask.sum())
    sums = MetricSums(mask)
    sums.value("loss", torch.tensor(0.25))
    sums.value("moment", torch.tensor(1.5, dtype=torch.float64))
    sums.count("flag_frac", flags, n)
    sums.count("flag_per_row", flags, 3)  # another denominator
    sums.mean("value_mean", values, n)  # inf and nan off the mask contribute 0
    got = sums.build().to_host()
    assert list(got) == ["loss", "moment", "flag_frac", "flag_per_row", "value_mean"]
    assert got["loss"] == 0.25 and got["moment"] == 1.5
    assert got["flag_frac"] == int((flags & mask).sum()) / n
    assert got["flag_per_row"] == int((flags & mask).sum()) / 3
    assert got["value_mean"] == pytest.approx(float(values[mask].double().sum()) / n, rel=1e-15)


def test_metric_sums_over_no_tokens_are_zero():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    sums = MetricSums(mask)
    sums.count("frac", torch.ones(2, 3, dtype=torch.bool), 0)
    sums.mean("mean", torch.full((2, 3), math.nan), 0)
    assert sums.build().to_host() == {"frac": 0.0, "mean": 0.0}
    assert MetricSums(mask).build().to_host() == {}


def test_metric_sums_take_the_same_launches_for_six_metrics_or_twenty_four():
    mask, values, flags = _random_tokens(1)

    def launches(k: int) -> int:
        sums = MetricSums(mask)
        for i in range(k):
            sums.value(f"v{i}", values[0, 0])
            sums.count(f"c{i}", flags, 7)
            sums.mean(f"m{i}", values, 7)
        with Launches() as counted:
            sums.build()
        return counted.ops

    # what grows with the metrics is the stacks' size, not their number: one metric at a time took
    # four to six launches each
    assert launches(2) == launches(8) <= 12


def test_device_metrics_add_in_one_vector_and_refuse_other_names():
    a = DeviceMetrics(("x", "y"), torch.tensor([1.0, 2.0], dtype=torch.float64))
    b = DeviceMetrics(("x", "y"), torch.tensor([0.5, -1.0], dtype=torch.float64))
    total = a + b
    assert total.to_host() == {"x": 1.5, "y": 1.0}
    assert float(total["y"]) == 1.0 and list(total) == ["x", "y"] and len(total) == 2
    with pytest.raises(KeyError):
        total["z"]
    with pytest.raises(ValueError, match="cannot add"):
        a + DeviceMetrics(("y", "x"), a.vector)
    with pytest.raises(ValueError, match="repeat"):
        DeviceMetrics(("x", "x"), a.vector)
    with pytest.raises(ValueError, match="2 names"):
        DeviceMetrics(("x", "y"), torch.zeros(3, dtype=torch.float64))


def test_sum_metrics_of_device_vectors_equals_the_sum_per_name():
    parts = [DeviceMetrics(("a", "b"), torch.tensor([i, 2.0 * i], dtype=torch.float64)) for i in range(1, 4)]
    summed = sum_metrics(parts)
    assert isinstance(summed, DeviceMetrics) and summed.to_host() == {"a": 6.0, "b": 12.0}
    plain = sum_metrics([{"a": torch.tensor(1.0), "b": 2.0}, {"a": torch.tensor(3.0), "b": 4.0}])
    assert float(plain["a"]) == 4.0 and plain["b"] == 6.0
    mixed = sum_metrics([parts[0], {"a": torch.tensor(1.0, dtype=torch.float64)}])
    assert float(mixed["a"]) == 2.0 and float(mixed["b"]) == 2.0
    assert sum_metrics([]) == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_nonfinite_is_not_isfinite(dtype):
    info = torch.finfo(dtype)
    x = torch.tensor(
        [0.0, -0.0, 1.0, -3.5, info.max, -info.max, info.tiny, info.tiny / 4, math.inf, -math.inf, math.nan],
        dtype=dtype,
    )
    assert torch.equal(nonfinite(x), ~torch.isfinite(x))


def _batch(seed: int = 3, B: int = 6, T: int = 12):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.25
    mu = -torch.rand(B, T, generator=g) * 3
    old = mu + torch.randn(B, T, generator=g) * 0.3
    return ObjectiveInputs(
        loss_mask_B_T=mask,
        old_logprobs_B_T=old,
        behaviour_logprobs_B_T=mu,
        versions_B_T=torch.where(mask, 0, -1),
        rewards_B=torch.arange(B, dtype=torch.float32) % 2,
        group_ids_B=torch.arange(B) // 2,
        learner_version=1,
    )


def test_behaviour_diagnostics_equal_a_numpy_reference():
    inputs = _batch()
    valid = inputs.loss_mask_B_T
    log_w = torch.where(valid, inputs.old_logprobs_B_T - inputs.behaviour_logprobs_B_T, 0.0)
    sums = MetricSums(valid)
    behaviour_diagnostics(sums, log_w, valid, int(valid.sum()))
    got = sums.build().to_host()
    lw = log_w[valid].double().numpy()
    w = np.exp(lw)
    for q in RATIO_QUANTILES:
        assert got[f"ratio/q{round(q * 100):02d}"] == pytest.approx(np.quantile(w, q), rel=1e-12)
    # to an ulp: torch's vectorised exp and numpy's may round the last bit apart on some CPUs
    assert got["ratio/min"] == pytest.approx(w.min(), rel=1e-15) and got["ratio/max"] == pytest.approx(
        w.max(), rel=1e-15
    )
    assert got["ratio/mean"] == pytest.approx(w.mean(), rel=1e-12)
    assert got["mismatch/ess"] == pytest.approx(w.sum() ** 2 / (len(w) * (w**2).sum()), rel=1e-12)
    assert got["mismatch/kl_k1"] == pytest.approx((-lw).mean(), rel=1e-12)
    assert got["mismatch/kl_k2"] == pytest.approx((lw**2 / 2).mean(), rel=1e-12)
    assert got["mismatch/kl_k3"] == pytest.approx((w - 1 - lw).mean(), rel=1e-12)
    assert got["mismatch/abs_log_ratio_mean"] == pytest.approx(np.abs(lw).mean(), rel=1e-6)


def test_behaviour_diagnostics_of_one_token_and_of_none():
    valid = torch.zeros(2, 4, dtype=torch.bool)
    log_w = torch.zeros(2, 4)
    sums = MetricSums(valid)
    behaviour_diagnostics(sums, log_w, valid, 0)
    assert sums.build().to_host() == {"mismatch/abs_log_ratio_mean": 0.0}  # the rest need a token
    valid[1, 2], log_w[1, 2] = True, 0.5
    sums = MetricSums(valid)
    behaviour_diagnostics(sums, log_w, valid, 1)
    got = sums.build().to_host()
    ratio = math.exp(0.5)
    assert all(got[f"ratio/q{round(q * 100):02d}"] == pytest.approx(ratio) for q in RATIO_QUANTILES)
    assert got["ratio/min"] == got["ratio/max"] == pytest.approx(ratio) and got[
        "mismatch/ess"
    ] == pytest.approx(1.0)


def test_m2po_mask_reads_nothing_back_from_the_device():
    g = torch.Generator().manual_seed(4)
    lw = torch.randn(8, 30, generator=g, dtype=torch.float64)
    adv = torch.randn(8, 1, generator=g, dtype=torch.float64).expand(8, 30)
    keep = torch.rand(8, 30, generator=g) > 0.2
    with Launches() as counted, ToList() as listed:
        res = m2po_mask(lw, keep, adv, tau=0.04)
    assert counted.reads == 0 and listed.calls == 0
    assert bool(res.masked_B_T.any()) and float(res.second_moment_after) <= 0.04 + 1e-12


@pytest.mark.parametrize("corrections", [[TIS()], [TIS(), M2PO(tau=0.04)]], ids=["tis", "tis+m2po"])
def test_prepare_reads_once_and_the_loss_never(corrections):
    cfg = ObjectiveConfig(corrections=corrections)
    inputs = _batch()
    terms = batch_terms(cfg, inputs.batch)
    with Launches() as counted, ToList() as listed:
        prepared = prepare(cfg, inputs, terms, values_checked=True)
    assert counted.reads == 0 and listed.calls == 1  # every diagnostic in the one copy
    logp = inputs.old_logprobs_B_T.clone().requires_grad_(True)
    with Launches() as counted, ToList() as listed:
        loss, metrics = policy_loss(cfg, logp, prepared, device_metrics=True)
    assert counted.reads == 0 and listed.calls == 0
    assert isinstance(metrics, DeviceMetrics) and math.isfinite(float(loss.detach()))
    # the metrics a micro-batch returns are the formulas: one step, so the ratio is 1 and nothing clips
    host = metrics.to_host()
    assert host["policy/ratio_mean"] == pytest.approx(1.0) and host["policy/clip_frac"] == 0.0
    assert host["loss/total"] == pytest.approx(float(loss.detach()))
