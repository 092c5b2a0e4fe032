"""``benchmarks/step_profile.py``: the per-step figures it reads off a profile, and its CPU smoke run."""

from __future__ import annotations

import functools
import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.autograd import DeviceType

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def step_profile() -> ModuleType:
    """The script as a module; benchmarks/ goes on ``sys.path`` (last): it imports its helpers beside it."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    return importlib.import_module("step_profile")


@dataclass
class Range:
    start: float
    end: float

    def elapsed_us(self) -> float:
        return self.end - self.start


@dataclass
class Event:  # the fields of torch.profiler's FunctionEvent that summarise reads
    name: str
    device_type: DeviceType
    time_range: Range
    self_cpu_time_total: float = 0.0


def kernel(name: str, start: float, end: float) -> Event:
    return Event(name, DeviceType.CUDA, Range(start, end))


def host(name: str, self_us: float = 0.0) -> Event:
    return Event(name, DeviceType.CPU, Range(0.0, self_us), self_us)


def test_union_of_intervals_counts_overlaps_once():
    sp = step_profile()
    assert sp.union_us([]) == 0.0
    assert sp.union_us([(0, 10), (20, 30)]) == 20.0  # disjoint
    assert sp.union_us([(0, 10), (5, 15)]) == 15.0  # overlapping
    assert sp.union_us([(0, 30), (5, 10), (40, 50)]) == 40.0  # nested, then apart
    assert sp.union_us([(20, 30), (0, 25)]) == 30.0  # order does not matter


def test_cuda_summary_per_step():
    sp = step_profile()
    events = [
        kernel("gemm", 0, 4_000),
        kernel("gemm", 3_000, 6_000),  # overlaps the first: busy counts it once, the op total twice
        kernel("softmax", 10_000, 12_000),
        host("aten::_local_scalar_dense"),
        host("aten::nonzero"),
        host("aten::_local_scalar_dense"),
        host("cudaStreamSynchronize"),
        host("cudaDeviceSynchronize"),
        host("cudaLaunchKernel"),
        host("cudaLaunchKernelExC"),
        host("aten::mm", 500.0),  # host op time is not the device's on CUDA
    ]
    s = sp.summarise(events, wall_s=0.020, steps=2, device="cuda")
    assert s["wall_ms"] == pytest.approx(10.0)
    assert s["busy_ms"] == pytest.approx(4.0)  # (6 + 2) ms of device time over 2 steps
    assert s["idle_frac"] == pytest.approx(0.6)
    assert (s["host_reads"], s["syncs"], s["launches"]) == (1.5, 1.0, 1.0)
    assert s["ops_ms"] == pytest.approx({"gemm": 3.5, "softmax": 1.0})
    assert list(s["ops_ms"]) == ["gemm", "softmax"]  # largest first


def test_phases_are_host_time_per_step_and_their_device_mirror_is_neither_busy_nor_an_op():
    sp = step_profile()
    events = [
        host("labrl/forward", 3_000.0),
        host("labrl/forward", 1_000.0),
        host("labrl/objective", 500.0),
        Event("labrl/forward", DeviceType.CUDA, Range(0, 9_000)),  # the profiler's device-side mirror
        kernel("gemm", 0, 2_000),
    ]
    s = sp.summarise(events, wall_s=0.010, steps=2, device="cuda")
    assert s["phases_ms"] == pytest.approx({"forward": 2.0, "objective": 0.25})
    assert list(s["phases_ms"]) == ["forward", "objective"]  # largest first
    assert s["busy_ms"] == pytest.approx(1.0) and s["ops_ms"] == pytest.approx({"gemm": 1.0})


def test_cpu_summary_times_aten_ops_and_has_no_idle_share():
    sp = step_profile()
    s = sp.summarise([host("aten::mm", 3_000.0), host("aten::add", 1_000.0), host("other", 9_000.0)],
                     wall_s=0.005, steps=1, device="cpu")  # fmt: skip
    assert s["ops_ms"] == pytest.approx({"aten::mm": 3.0, "aten::add": 1.0})
    assert s["busy_ms"] == 0.0 and s["idle_frac"] is None


def test_diff_orders_by_the_largest_difference_either_way():
    sp = step_profile()
    a = {"ops_ms": {"gemm": 10.0, "cat": 3.0, "fill": 1.0}}
    b = {"ops_ms": {"gemm": 9.5, "fill": 6.0, "copy": 2.0}}
    rows = sp.ops_diff(a, b, top=3)
    assert [(r["op"], r["diff_ms"]) for r in rows] == [("fill", -5.0), ("cat", 3.0), ("copy", -2.0)]


def test_the_cpu_smoke_run_profiles_both_paths(tmp_path):
    out = tmp_path / "profile.json"
    assert (
        step_profile().main(["--device", "cpu", "--shapes", "tiny", "--steps", "1", "--out", str(out)]) == 0
    )
    result = json.loads(out.read_text())
    shape = result["shapes"]["tiny-moe"]
    labrl, bare = shape["labrl"], shape["bare_fp32_master"]
    for r in (labrl, bare):
        assert r["wall_ms"] > 0 and r["ops_total_ms"] > 0 and "aten::mm" in r["ops_ms"]
    # labrl's step reads the batch's counts, metrics and the grad norm back; the bare step does less
    assert labrl["host_reads"] > bare["host_reads"] > 0
    # labrl's named ranges, and none in the bare step
    assert {"batch_terms", "upload", "forward", "objective", "backward", "clip", "optimizer"} <= set(
        labrl["phases_ms"]
    )
    assert bare["phases_ms"] == {}
    assert shape["diff"] and all("diff_ms" in r for r in shape["diff"])


def test_bad_arguments_are_refused():
    sp = step_profile()
    with pytest.raises(SystemExit):
        sp.main(["--device", "cpu", "--shapes", "huge"])
    with pytest.raises(SystemExit):
        sp.main(["--device", "cpu", "--steps", "0"])


def test_device_ops_count_launches_and_reads_by_phase():
    import torch

    sp = step_profile()
    counter = sp.DeviceOps()
    x = torch.arange(6, dtype=torch.float32, device="cpu")
    mask = x > 2
    with sp.HostCopies(counter, torch.device("cpu")), counter:
        y = x + 1  # a launch
        y.view(2, 3)  # a view: none
        torch.where(mask, x, 0.0)  # a launch (its 0.0 is a wrapped CPU scalar, a kernel argument)
        with counter.phase("objective"):
            x[mask]  # a launch and a read (its size is the mask's count)
            float(x.sum())  # a launch and a read
            x.tolist()  # a read
            torch.tensor([1, 2], device="cpu")  # a host-to-device copy
        with counter.phase("batch_terms"):  # labrl's host-side phase: neither
            x * 2
            int(x.max())
    assert dict(counter.ops) == {
        ("step", "add"): 1,
        ("step", "where"): 1,
        ("objective", "index"): 1,
        ("objective", "sum"): 1,
        ("objective", "copy (host to device)"): 1,
    }
    assert dict(counter.reads) == {"objective": 3}


def test_the_op_count_books_labrls_reads_to_its_two_copies(tmp_path):
    out = tmp_path / "ops.json"
    args = ["--count-ops", "--device", "cpu", "--shapes", "tiny", "--objective", "default", "--out", str(out)]
    assert step_profile().main(args) == 0
    shape = json.loads(out.read_text())["shapes"]["tiny-moe"]
    labrl, bare = shape["labrl_default"], shape["bare_fp32_master"]
    assert set(bare["by_phase"]) == {"step"} and bare["ops"] > 700
    assert {"forward", "backward", "objective", "prepare", "checks", "optimizer"} <= set(labrl["by_phase"])
    # megatron-core's own reads (its dispatcher sizes a buffer by the routing) are in both; labrl adds
    # prepare's one copy of its diagnostics and the step's one of its checks, grad norm and metrics
    assert labrl["reads_by_phase"] == {"forward": bare["reads"], "prepare": 1, "checks": 1}
    # the RL objective, the clip and the log-prob gather on top of bare megatron-core's step: 1.33x
    # the ops at main db7a4a6, 1.22x since (benchmarks/README.md, "Step profile")
    assert labrl["ops"] < 1.25 * bare["ops"]


def test_on_cuda_the_profile_also_times_the_step_with_the_objective_compiled(monkeypatch):
    sp = step_profile()
    built = []
    monkeypatch.setattr(sp, "labrl_step", lambda *args, **kw: built.append(kw) or "step")
    monkeypatch.setattr(sp, "megatron_step", lambda *args, **kw: ("bare step", None))
    paths = dict(sp.profile_paths("tiny", torch.device("cuda")))
    assert list(paths) == ["labrl", "labrl_compiled_objective", "bare_fp32_master"]
    assert [paths[k]() for k in paths] == ["step", "step", "bare step"]
    assert built == [{}, {"objective_kernel": "compiled"}]  # labrl's default, then compiled
    assert list(dict(sp.profile_paths("tiny", torch.device("cpu")))) == ["labrl", "bare_fp32_master"]


def test_host_time_calls_every_path_in_turn_on_one_thread_and_divides_per_round(monkeypatch):
    sp = step_profile()
    calls: list[tuple[str, int]] = []
    now = [0.0]
    seconds = {"labrl": 2.0, "compiled": 4.0, "bare": 1.0}  # a call's length on the fake clock

    def fake(name):
        def step():
            calls.append((name, torch.get_num_threads()))
            now[0] += seconds[name]

        return step

    monkeypatch.setattr(sp, "labrl_step", lambda *a, **kw: fake("compiled" if kw else "labrl"))
    monkeypatch.setattr(sp, "megatron_step", lambda *a, **kw: (fake("bare"), None))
    monkeypatch.setattr(sp, "alternating", functools.partial(sp.alternating, clock=lambda: now[0]))
    threads = torch.get_num_threads()
    res = sp.host_time_shape("host", 2, torch.device("cpu"))
    assert torch.get_num_threads() == threads  # restored
    assert {n for _, n in calls} == {1}  # every call on one intra-op thread
    warm_up = ["labrl"] * 3 + ["compiled"] * 3 + ["bare"] * 3
    rounds = ["labrl", "compiled", "bare", "bare", "compiled", "labrl"]  # in turn, reversed every other round
    assert [name for name, _ in calls] == warm_up + rounds
    assert (res["B"], res["T"], res["micro_batch"], res["rounds"]) == (4, 8, 2, 2)
    assert res["labrl"] == pytest.approx({"median_ms": 2e3, "min_ms": 2e3, "bare_over_path": 0.5})
    assert res["labrl_compiled_objective"]["bare_over_path"] == pytest.approx(0.25)
    assert res["bare_fp32_master"]["bare_over_path"] == 1.0


def test_the_cpu_host_time_run_writes_each_paths_time_and_ratio(tmp_path):
    out = tmp_path / "host.json"
    assert step_profile().main(["--host-time", "--device", "cpu", "--rounds", "2", "--out", str(out)]) == 0
    shape = json.loads(out.read_text())["shapes"]["host"]
    assert (shape["shape"], shape["B"], shape["T"]) == ("tiny-moe", 4, 8)
    assert shape["bare_fp32_master"]["bare_over_path"] == 1.0
    for key in ("labrl", "labrl_compiled_objective"):
        r = shape[key]
        assert 0 < r["min_ms"] <= r["median_ms"] and 0 < r["bare_over_path"] < 10


@pytest.mark.parametrize(
    "args",
    [
        ["--host-time", "--rounds", "0"],
        ["--shapes", "host"],  # nothing to profile there
        ["--host-time", "--count-ops"],
    ],
)
def test_bad_host_time_arguments_are_refused(args):
    with pytest.raises(SystemExit):
        step_profile().main(["--device", "cpu", *args])
