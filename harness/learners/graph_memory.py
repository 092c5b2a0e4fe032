"""How much memory a kept autograd graph holds, and whether one more fits.

Under a whole-batch term (M2PO) with one optimizer step per batch, the learner
can run every micro-batch's loss forward first, keep its graph, and run the
backward passes once the whole batch's proximal log-probs are known, instead
of a separate no-grad forward over the batch (``labrl.harness.learners.proximal``).
Kept graphs cost memory: micro-batch ``i``'s saved activations ``a_i`` stay
alive until its backward. A graph is kept when

    sum(a_j, j kept) + a_i + reserve  <=  fraction * free

with ``free`` the device's free memory at the start of the step (before the
first forward), ``reserve`` the step's gradients (the model's and, under bf16,
the fp32 masters', which the first backward allocates while every kept graph is
still alive) plus the largest ``a_j`` for that backward's own transient tensors,
and ``fraction`` = ``learner.graph_memory_fraction``. ``a_i`` of a micro-batch
not yet run is the largest bytes-per-token seen so far in this step times its
tokens; the first micro-batch is always kept (nothing measured yet, and its
graph is what the separate forward's first micro-batch holds anyway). A
micro-batch whose graph does not fit gets a no-grad forward for its proximal
log-probs now and its loss forward with the backward later, as with the
separate forward. Across model-parallel ranks the decision must be the same
(a rank that runs a micro-batch's forward while another runs its backward
would pair their collectives wrongly), so with more than one process every
rank keeps a graph only if all of them may (``agreed``).

``a_i`` is measured, not modelled: ``SavedBytes`` counts the storages autograd
saves for backward during the forward (``torch.autograd.graph.saved_tensors_hooks``),
each storage once, the model's parameters left out, on any device.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

import torch

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


class SavedBytes:
    """Bytes of the storages autograd saves for backward inside the ``with`` block.

    Each storage counts once (a view of a saved tensor adds nothing), and the
    storages in ``exclude`` (``storages`` of the parameters, which exist anyway) not at all. The
    pack hook keeps ``t.detach()``: the same storage and version counter, so
    backward reads what it would have, without the tensor's autograd history.
    Keeping ``t`` itself would, for a saved output, make a cycle through
    autograd's C++ graph (output -> grad_fn -> saved output) that Python's
    collector cannot see: a graph dropped without a backward would never be
    freed.
    """

    def __init__(self, exclude: frozenset[int] = frozenset()) -> None:
        self._seen = set(exclude)
        self.bytes = 0
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._seen:
            self._seen.add(ptr)
            self.bytes += storage.nbytes()
        return t.detach()

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(kind, exc, tb)
        self._hooks = None  # it holds self._pack: a cycle for the collector


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def storages(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    """The addresses of the storages behind ``tensors`` (what ``SavedBytes`` leaves out)."""
    return frozenset(t.untyped_storage().data_ptr() for t in tensors)


def free_memory_bytes(device: torch.device) -> int:
    """Memory this process could still allocate on ``device``.

    CUDA: the driver's free memory plus what torch's caching allocator holds
    unused. CPU: ``MemAvailable`` of ``/proc/meminfo``, or less where the
    process's cgroup (v2) limit leaves less (``host_free_bytes``).
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached)
    return host_free_bytes(_read(MEMINFO), _read(CGROUP / "memory.max"), _read(CGROUP / "memory.current"))


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def host_free_bytes(meminfo: str | None, cgroup_max: str | None, cgroup_current: str | None) -> int:
    """Available host memory from the texts of ``/proc/meminfo`` and the cgroup's ``memory.max`` and
    ``memory.current`` (each None when unreadable): ``min(MemAvailable, max - current)``.

    Without ``MemAvailable``, the free physical pages (``os.sysconf``); a cgroup limit of ``max`` is none.
    """
    available = None
    for line in (meminfo or "").splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            available = int(value.split()[0]) * 1024  # kB
            break
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = (cgroup_max or "").strip()
    current = (cgroup_current or "").strip()
    if limit.isdigit() and current.isdigit():
        available = min(available, max(0, int(limit) - int(current)))
    return available


def gradient_bytes(model_params: Iterable[torch.Tensor], master: bool) -> int:
    """Bytes of a step's gradients: each parameter's in its own dtype, plus an fp32 copy under fp32 masters."""
    total = 0
    for p in model_params:
        total += p.numel() * (p.element_size() + (4 if master else 0))
    return total


def agreed(keep: bool, device: torch.device) -> bool:
    """``keep`` on every rank of the default process group (a MIN all-reduce), or ``keep`` alone without one."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return keep
    if torch.distributed.get_world_size() == 1:
        return keep
    flag = torch.tensor([int(keep)], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


class GraphBudget:
    """The rule of the module docstring for one step: which micro-batches keep their graph."""

    def __init__(self, *, free_bytes: int, fraction: float, gradient_bytes: int) -> None:
        if not 0 < fraction < 1:
            raise ValueError(f"fraction must be in (0, 1), got {fraction}")
        self.limit = fraction * free_bytes
        self.gradient_bytes = gradient_bytes
        self.kept_bytes = 0
        self.kept = 0
        self.largest = 0
        self._bytes_per_token = 0.0

    def estimate(self, tokens: int) -> int:
        """Saved bytes of a micro-batch of ``tokens`` (padded) tokens: the largest rate seen times ``tokens``."""
        return math.ceil(self._bytes_per_token * tokens)

    def admits(self, tokens: int) -> bool:
        """Whether the next micro-batch, of ``tokens`` tokens, keeps its graph."""
        if self.kept == 0:
            return True
        graph = self.estimate(tokens)
        backward = max(graph, self.largest)  # the first backward's transients, with every kept graph alive
        return self.kept_bytes + graph + self.gradient_bytes + backward <= self.limit

    def record(self, tokens: int, saved_bytes: int) -> None:
        """A kept graph of ``tokens`` tokens measured at ``saved_bytes``."""
        self.kept += 1
        self.kept_bytes += saved_bytes
        self.largest = max(self.largest, saved_bytes)
        self._bytes_per_token = max(self._bytes_per_token, saved_bytes / max(1, tokens))
