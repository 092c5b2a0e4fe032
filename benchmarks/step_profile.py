"""Where a training step's time goes: labrl's ``train_step`` against bare megatron-core under the same
precision policy, profiled side by side (issue 26: the gap left after the same experts and precision).

Both paths build the same model (``build_gpt_model``, bf16, ``TorchGroupedMLP`` experts) and step it on a
B x T batch in micro-batches; bare megatron-core is ``gpu_learner.megatron_step(fp32_master=True)``:
forward, cross-entropy, backward, fp32 gradient accumulation, AdamW on fp32 master weights, copy back,
and nothing else. ``--steps`` steps of each run under ``torch.profiler`` after one warm-up step, and per
step this reports:

- ``wall_ms``: host wall time (the device synchronised before and after);
- ``busy_ms``: the union of the device's intervals (kernels, copies, fills); ``idle_frac`` =
  1 - busy / wall, the share of the step the device waited for the host;
- ``host_reads``: ``aten::_local_scalar_dense`` (``.item()``, ``float()``, ``int()``, ``bool()`` of a
  tensor) and ``aten::nonzero`` (boolean-mask indexing), each a wait for the device on CUDA (a
  ``.tolist()`` is not among them: on CUDA it shows as a copy and a synchronise);
  ``syncs``: the CUDA runtime's synchronise calls (``cuda*Synchronize``), every wait on CUDA;
  ``launches``: kernel launches;
- ``ops``: time per name: device kernels on CUDA, aten ops' self CPU time on CPU (``--device cpu``, a
  smoke run: there the whole step is host time);
- ``phases_ms`` (labrl's step only): the host time in each of ``train_step``'s named ranges
  (``labrl/forward``, ``labrl/objective``, ``labrl/backward``, ``labrl/checks`` (the step's one read
  of its checks, grad norm and metrics), ``labrl/clip``, ``labrl/optimizer``, ``labrl/prepare``, ...;
  ``megatron.phase``; ``labrl/objective`` holds the
  frozen reference's forward when a KL term needs one), waits for the device included:
  a phase long on the host while the device idles is where a gap is;

then the two paths' ``ops`` differences, largest first (``diff``): what labrl's step adds or saves.
On CUDA a third path, ``labrl_compiled_objective``, is labrl's step with ``learner.objective_kernel:
compiled`` (the objective through ``torch.compile``; eager is the default): what compiling it saves.

``--count-ops`` counts instead of timing: the device ops of one step of each path (after a warm-up
step), by op name and, for labrl's step, by phase, with ``--objective quickstart`` also under the
quickstart configs' objective, eager (the default; dynamo compiles nothing under the counting
dispatch mode, and the timed run above says what compiling saves). A device op is what dispatches a kernel on CUDA, counted with a
``TorchDispatchMode`` below autograd (backward ops included): every non-view aten op but the
allocations without a fill (``empty*``), the profiler's range markers, ``scalar_tensor`` (the
wrapped CPU scalar of ``where(mask, x, 0.0)``: a kernel argument on CUDA, not a launch) and host
reads (``_local_scalar_dense``, counted apart as ``reads``), leaving out labrl's ``batch_checks``,
``batch_terms`` and ``upload`` phases (the host copy of the batch). AdamW counts as its fused kernel, as on CUDA. On a
launch-bound shape (the tiny one: its H200 step times are tens of microseconds per op) the step time
follows the op count, so this runs on CPU and says what a change saves before a GPU times it:

    .venv/bin/python benchmarks/step_profile.py --count-ops --device cpu --shapes tiny --objective both

``--host-time`` times instead of profiling, at a shape with next to no arithmetic (``host``: the tiny
shape's model and two micro-batches, B=4 T=8): labrl's step, labrl's with the objective compiled and
bare megatron-core's, called in turn for ``--rounds`` rounds after a warm-up (the device waited for
around each call; on CPU one intra-op thread, as a GPU step's host side has), each path's median
milliseconds and ``bare/path``, the median of the rounds' ratios. There the step is host time: the
Python and dispatch of every op, which is what a launch-bound GPU step waits on (the H200's tiny
shape: 29-59 ms for about a thousand ops, tens of microseconds each), so its ratio says on CPU what
a change does to that shape, in time where ``--count-ops`` says it in ops:

    .venv/bin/python benchmarks/step_profile.py --host-time --device cpu

    python3 benchmarks/step_profile.py                       # on a GPU node: both shapes (~1 min)
    .venv/bin/python benchmarks/step_profile.py --device cpu --shapes tiny --steps 1   # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from unittest import mock

import torch
from _quickstart import quickstart_learner_fields
from _results import RESULTS  # beside this script
from _timing import alternating, device_sync, paired_ratio
from _torch_threads import one_thread_on_cpu
from gpu_learner import BIG_MODEL, QUICKSTART_MODEL, free_cuda, megatron_step, synthetic_batch
from torch.autograd import DeviceType
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from labrl._warnings import quiet_expected_warnings
from labrl.harness.learners import LearnerConfig, MegatronLearner
from labrl.harness.learners import megatron as megatron_learner
from labrl.harness.learners.megatron import PHASE_PREFIX

SHAPES = {
    "tiny": (QUICKSTART_MODEL, 64, 200, 32),
    "big": (BIG_MODEL, 16, 2048, 2),
    "host": (QUICKSTART_MODEL, 4, 8, 2),  # next to no arithmetic: the step is host time (--host-time)
}
HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero")
# the objectives labrl's step runs under: the learner's default, and the quickstart configs' one
OBJECTIVES = {
    "default": {},
    "quickstart": quickstart_learner_fields(),
}
NOT_LAUNCHES = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "scalar_tensor",
     "_record_function_enter_new", "_record_function_exit"}
)  # fmt: skip
# ops whose output size is a count of the values: on CUDA the host waits for it
SIZED_BY_VALUES = frozenset({"nonzero", "masked_select"})
BOOL_INDEXED = frozenset({"index", "index_put", "index_put_"})  # with a bool mask: a nonzero inside


def _to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a call copies a device tensor to the host (``.cpu()``, ``.to("cpu")``: a wait on CUDA)."""
    if name != "_to_copy" or kwargs.get("device") is None or not args:
        return False
    return torch.device(kwargs["device"]).type == "cpu" and args[0].device.type != "cpu"


def _bool_index(args: tuple) -> bool:
    """Whether an ``aten.index``/``index_put`` call indexes by a bool mask (its second argument's list)."""
    indices = args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


HOST_ONLY_PHASES = frozenset({"batch_checks", "batch_terms", "upload"})  # on the host copy of the batch


def union_us(spans: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def summarise(events: Iterable, wall_s: float, steps: int, *, device: str) -> dict:
    """Per-step figures of one profiled run (module docstring) from torch.profiler's ``FunctionEvent``s:
    each has ``name``, ``device_type``, ``time_range`` (``start``, ``end`` in us) and ``self_cpu_time_total``."""
    per_name: dict[str, float] = defaultdict(float)
    phases: dict[str, float] = defaultdict(float)
    spans = []
    host_reads = syncs = launches = 0
    for e in events:
        on_device = e.device_type != DeviceType.CPU
        if e.name.startswith(PHASE_PREFIX):
            # a named range of labrl's step; on CUDA the profiler mirrors it on the device timeline
            # (a span over the range's kernels, not a kernel: neither busy time nor an op)
            if not on_device:
                phases[e.name.removeprefix(PHASE_PREFIX)] += e.time_range.elapsed_us()
            continue
        if on_device:
            spans.append((e.time_range.start, e.time_range.end))
            if device != "cpu":
                per_name[e.name] += e.time_range.elapsed_us()
            continue
        if e.name in HOST_READS:
            host_reads += 1
        elif e.name.startswith("cuda") and e.name.endswith("Synchronize"):
            syncs += 1
        elif e.name.startswith("cudaLaunchKernel"):
            launches += 1
        if device == "cpu" and e.name.startswith("aten::"):
            per_name[e.name] += e.self_cpu_time_total
    wall_ms = wall_s * 1e3 / steps
    busy_ms = union_us(spans) / 1e3 / steps
    ops = sorted(per_name.items(), key=lambda kv: -kv[1])
    return {
        "device": device,
        "steps": steps,
        "wall_ms": wall_ms,
        "busy_ms": busy_ms,
        # no device timeline on CPU: there the whole step is host time
        "idle_frac": max(0.0, 1.0 - busy_ms / wall_ms) if device != "cpu" and wall_ms > 0 else None,
        "host_reads": host_reads / steps,
        "syncs": syncs / steps,
        "launches": launches / steps,
        "ops_ms": {name: us / 1e3 / steps for name, us in ops},  # every name: the diff reads them all
        "ops_total_ms": sum(per_name.values()) / 1e3 / steps,
        "phases_ms": {name: us / 1e3 / steps for name, us in sorted(phases.items(), key=lambda kv: -kv[1])},
    }


def ops_diff(a: dict, b: dict, top: int = 15) -> list[dict]:
    """Per op name, ``a``'s milliseconds per step minus ``b``'s, largest absolute difference first."""
    names = set(a["ops_ms"]) | set(b["ops_ms"])
    rows = [{"op": n, "a_ms": a["ops_ms"].get(n, 0.0), "b_ms": b["ops_ms"].get(n, 0.0)} for n in names]
    for r in rows:
        r["diff_ms"] = r["a_ms"] - r["b_ms"]
    return sorted(rows, key=lambda r: -abs(r["diff_ms"]))[:top]


def profile(step: Callable[[], object], steps: int, device: torch.device) -> dict:
    """One warm-up step, then ``steps`` steps under the profiler, summarised per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    sync = device_sync(device)
    step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = time.perf_counter() - started
    return summarise(prof.events(), wall, steps, device=device.type)


class DeviceOps(TorchDispatchMode):
    """Counts the device ops dispatched while active (module docstring), by ``(phase, op name)``, and the
    host reads; ``HostCopies`` adds what the dispatcher does not see on CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[tuple[str, str]] = Counter()
        self.reads: Counter[str] = Counter()  # by phase
        self.phases = ["step"]  # labrl's named ranges, innermost last; "step" outside any

    @property
    def on_device(self) -> bool:
        return self.phases[-1] not in HOST_ONLY_PHASES

    def read(self) -> None:
        if self.on_device:
            self.reads[self.phases[-1]] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" or _to_host(name, args, kwargs or {}):
            self.read()
        elif not func.is_view and name not in NOT_LAUNCHES and self.on_device:
            self.ops[(self.phases[-1], name)] += 1
            if name in SIZED_BY_VALUES or (name in BOOL_INDEXED and _bool_index(args)):
                self.read()
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Stands in for ``megatron.phase`` while counting, so each op is booked to labrl's range."""
        self.phases.append(name)
        try:
            yield
        finally:
            self.phases.pop()


class HostCopies(TorchFunctionMode):
    """What a CPU run's dispatcher does not show of a CUDA step: ``Tensor.tolist`` (a device-to-host copy
    and a wait there) as a read, and ``torch.tensor(data, device=...)`` on the step's device (a
    host-to-device copy) as an op, ``copy (host to device)``."""

    def __init__(self, ops: DeviceOps, device: torch.device) -> None:
        super().__init__()
        self.counter = ops
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counter.on_device:
            if func is torch.Tensor.tolist:
                self.counter.read()
            elif func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
                if torch.device(kwargs["device"]).type == self.device.type:
                    self.counter.ops[(self.counter.phases[-1], "copy (host to device)")] += 1
        return func(*args, **kwargs)


def count_ops(step: Callable[[], object], device: torch.device) -> dict:
    """The device ops of one ``step`` (after a warm-up step): total, by phase and by op name."""
    step()
    counter = DeviceOps()
    with mock.patch.object(megatron_learner, "phase", counter.phase), HostCopies(counter, device), counter:
        step()
    by_phase: Counter[str] = Counter()
    by_op: Counter[str] = Counter()
    in_phase: dict[str, Counter[str]] = defaultdict(Counter)
    for (phase_name, op), n in counter.ops.items():
        by_phase[phase_name] += n
        by_op[op] += n
        in_phase[phase_name][op] += n
    return {
        "ops": sum(by_op.values()),
        "reads": sum(counter.reads.values()),
        "reads_by_phase": dict(counter.reads.most_common()),
        "by_phase": dict(by_phase.most_common()),
        "by_op": dict(by_op.most_common()),
        "by_phase_and_op": {p: dict(in_phase[p].most_common()) for p in by_phase},
    }


@contextlib.contextmanager
def fused_adamw() -> Iterator[None]:
    """AdamW as its fused kernel on any device, as labrl picks it on CUDA (``device.adamw_kernel``)."""
    from labrl.harness.models import device as dev

    with mock.patch.object(dev, "adamw_kernel", lambda device: "fused"):
        yield


def count_shape(name: str, objectives: list[str], device: torch.device) -> dict:
    """``count_ops`` of bare megatron-core's step and of labrl's under each of ``objectives``."""
    cfg, B, T, mbs = SHAPES[name]
    out: dict = {"shape": cfg.name, "B": B, "T": T, "micro_batch": mbs}
    with fused_adamw():
        step = megatron_step(cfg, B, T, mbs, "grouped_mm", fp32_master=True, device=device)[0]
        out["bare_fp32_master"] = count_ops(step, device)
        for objective in objectives:
            learner_step = labrl_step(cfg, B, T, mbs, device, **OBJECTIVES[objective])
            out[f"labrl_{objective}"] = count_ops(learner_step, device)
    return out


def print_counts(res: dict) -> None:
    bare = res["bare_fp32_master"]["ops"]
    print(f"\n{res['shape']}: B={res['B']} T={res['T']} micro-batch {res['micro_batch']}, device ops a step")
    print(f"{'path':22} {'ops':>6} {'reads':>6} {'bare/path':>10}  by phase")
    for key, r in res.items():
        if isinstance(r, dict):
            phases = (
                ", ".join(f"{p} {n}" for p, n in r["by_phase"].items()) if key != "bare_fp32_master" else ""
            )
            print(f"{key:22} {r['ops']:6d} {r['reads']:6d} {bare / r['ops']:10.2f}  {phases}")


def labrl_step(
    cfg, B: int, T: int, mbs: int, device: torch.device, **learner: object
) -> Callable[[], object]:
    """labrl's ``train_step`` on ``gpu_learner``'s synthetic batch, bf16 with TorchGroupedMLP experts;
    ``learner``: further ``LearnerConfig`` fields (an objective, a reference)."""
    learner_model = MegatronLearner(
        LearnerConfig(
            model=cfg,
            micro_batch_size=mbs,
            router_replay=False,
            precision="bf16",
            experts="grouped_mm",
            device=str(device),
            **learner,  # type: ignore[arg-type]
        )
    )
    batch = synthetic_batch(cfg, B, T)
    return lambda: learner_model.train_step(batch)


def profile_paths(
    name: str, device: torch.device, *, compiled: bool | None = None
) -> list[tuple[str, Callable[[], Callable[[], object]]]]:
    """The paths ``profile_shape`` times on ``device``, each as a builder of its step: labrl's, labrl's
    with the objective compiled (what compiling it saves; ``compiled`` None: on CUDA only), and bare
    megatron-core's."""
    cfg, B, T, mbs = SHAPES[name]
    paths: list[tuple[str, Callable[[], Callable[[], object]]]] = [
        ("labrl", lambda: labrl_step(cfg, B, T, mbs, device))
    ]
    if device.type == "cuda" if compiled is None else compiled:
        compiled_step = functools.partial(labrl_step, cfg, B, T, mbs, device, objective_kernel="compiled")
        paths.append(("labrl_compiled_objective", compiled_step))
    bare = functools.partial(megatron_step, cfg, B, T, mbs, "grouped_mm", fp32_master=True, device=device)
    paths.append(("bare_fp32_master", lambda: bare()[0]))
    return paths


def profile_shape(name: str, steps: int, device: torch.device, save: Callable[[dict], None]) -> dict:
    """Every path of ``profile_paths`` on one shape, each freed before the next is built; ``save`` after each."""
    cfg, B, T, mbs = SHAPES[name]
    out: dict = {"shape": cfg.name, "B": B, "T": T, "micro_batch": mbs}
    for key, build in profile_paths(name, device):
        if device.type == "cuda":
            free_cuda()
        out[key] = profile(build(), steps, device)
        save(out)
    out["diff"] = ops_diff(out["labrl"], out["bare_fp32_master"])
    save(out)
    return out


def host_time_shape(name: str, rounds: int, device: torch.device) -> dict:
    """``profile_paths`` (the compiled objective among them) timed in alternation (module docstring):
    per path the median and fastest call, and ``bare_over_path``, the median of the rounds' ratios."""
    cfg, B, T, mbs = SHAPES[name]
    with one_thread_on_cpu(device), fused_adamw():
        steps = {key: build() for key, build in profile_paths(name, device, compiled=True)}
        times = alternating(steps, device_sync(device), rounds=rounds, warmup=3)
    bare = times["bare_fp32_master"]
    out: dict = {"shape": cfg.name, "B": B, "T": T, "micro_batch": mbs, "rounds": rounds}
    for key, seconds in times.items():
        out[key] = {
            "median_ms": statistics.median(seconds) * 1e3,
            "min_ms": min(seconds) * 1e3,
            "bare_over_path": paired_ratio(bare, seconds),
        }
    return out


def print_host_time(res: dict) -> None:
    print(f"\n{res['shape']}: B={res['B']} T={res['T']} micro-batch {res['micro_batch']}, "
          f"{res['rounds']} alternating rounds, ms a step")  # fmt: skip
    print(f"{'path':26} {'median':>8} {'fastest':>8} {'bare/path':>10}")
    for key, r in res.items():
        if isinstance(r, dict):
            print(f"{key:26} {r['median_ms']:8.2f} {r['min_ms']:8.2f} {r['bare_over_path']:10.3f}")


def print_shape(res: dict) -> None:
    print(f"\n{res['shape']}: B={res['B']} T={res['T']} micro-batch {res['micro_batch']}")
    print(
        f"{'path':22} {'wall ms':>9} {'busy ms':>9} {'idle':>6} {'host reads':>11} {'syncs':>7} {'launches':>9}"
    )
    for key in ("labrl", "labrl_compiled_objective", "bare_fp32_master"):
        r = res.get(key)
        if r is None:
            continue
        idle = "-" if r["idle_frac"] is None else f"{r['idle_frac']:.0%}"
        print(f"{key:22} {r['wall_ms']:9.1f} {r['busy_ms']:9.1f} {idle:>6} {r['host_reads']:11.0f} "
              f"{r['syncs']:7.0f} {r['launches']:9.0f}")  # fmt: skip
    phases = (res.get("labrl") or {}).get("phases_ms")
    if phases:
        print("\nlabrl train_step, host ms per phase (waits for the device included): "
              + ", ".join(f"{name} {ms:.1f}" for name, ms in phases.items()))  # fmt: skip
    if "diff" in res:
        print(f"\n{'op (labrl - bare, ms per step)':70} {'labrl':>8} {'bare':>8} {'diff':>8}")
        for r in res["diff"]:
            print(f"{r['op'][:70]:70} {r['a_ms']:8.2f} {r['b_ms']:8.2f} {r['diff_ms']:+8.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run)")
    ap.add_argument(
        "--shapes", default=None, help=f"which of {','.join(SHAPES)} (default big,tiny; --host-time: host)"
    )
    ap.add_argument("--steps", type=int, default=2, help="profiled steps per path, after one warm-up")
    ap.add_argument("--out", type=Path, default=None)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--count-ops", action="store_true", help="count each path's device ops, do not time them"
    )
    mode.add_argument(
        "--host-time", action="store_true", help="time the paths in alternating rounds, without the profiler"
    )
    ap.add_argument("--rounds", type=int, default=30, help="--host-time: rounds of one call of each path")
    ap.add_argument(
        "--objective",
        default="default",
        help=f"--count-ops: labrl's objective, {', '.join(OBJECTIVES)} or both",
    )
    args = ap.parse_args(argv)
    objectives = list(OBJECTIVES) if args.objective == "both" else [args.objective]
    if unknown := set(objectives) - set(OBJECTIVES):
        ap.error(f"--objective: unknown {sorted(unknown)}; choose from {', '.join(OBJECTIVES)} or both")
    shapes = [s for s in (args.shapes or ("host" if args.host_time else "big,tiny")).split(",") if s]
    if unknown := set(shapes) - set(SHAPES):
        ap.error(f"--shapes: unknown {sorted(unknown)}; choose from {','.join(SHAPES)}")
    if "host" in shapes and not args.host_time:
        ap.error("--shapes host is --host-time's shape (its arithmetic is next to none: nothing to profile)")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("step_profile: no CUDA device here (--device cpu for the smoke run)")
        return 0
    quiet_expected_warnings()
    kind = "op_count" if args.count_ops else "host_time" if args.host_time else "step_profile"
    out_path = args.out or RESULTS / f"{kind}_{device.type}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shapes": {},
    }

    def save(
        partial: dict, key: str | None = None
    ) -> None:  # after every path: a run stopped at its time limit keeps what it measured
        result["shapes"][key or partial["shape"]] = partial
        out_path.write_text(json.dumps(result, indent=1))

    for name in shapes:
        if args.host_time:  # keyed by the shape's name: "host" and "tiny" share a model
            timed = host_time_shape(name, args.rounds, device)
            save(timed, name)
            print_host_time(timed)
        elif args.count_ops:
            counts = count_shape(name, objectives, device)
            save(counts)
            print_counts(counts)
        else:
            print_shape(profile_shape(name, args.steps, device, save))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
