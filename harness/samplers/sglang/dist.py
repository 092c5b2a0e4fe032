"""Both ends of SGLang's weight-update process group (``update_weights_from_distributed``).

SGLang's ``/init_weights_update_group`` makes each server GPU join a
process group named ``group_name`` through ``init_custom_process_group``
(``sglang/srt/utils/common.py``): ``rendezvous("tcp://addr:port", rank,
world)`` gives a ``TCPStore`` (rank 0, the trainer, hosts it), which is
wrapped in ``PrefixStore(group_name, store)`` before
``_new_process_group_helper`` builds the group outside the default group.
Both ends must use the same prefix: with another group name the backends
look for each other's keys under different prefixes and wait until the
timeout (an NCCL hang on a real server). ``init_custom_group`` below does
exactly what SGLang does, so the trainer's end matches the server's on the
same torch version.

Transfer. Rank 0 broadcasts every tensor of a bucket in the order of the
bucket's ``names`` while each server's ``/update_weights_from_distributed``
call receives them (SGLang posts one ``broadcast`` per name, then calls
``model.load_weights`` on the bucket). ``plan_buckets`` cuts the model into
buckets of at most ``bucket_bytes`` (a larger tensor goes alone), so the
server never holds more than one bucket of received tensors besides its
weights.

``WeightReceiver`` is a server's end, used by the fake server (gloo on CPU;
NCCL on a CUDA device, ``receive_device``); it hands received tensors to a
loader (``load(names_and_tensors)``) like SGLang's ``model.load_weights``.
NCCL refuses two ranks of one group on the same GPU ("Duplicate GPU
detected"), so over NCCL the trainer and a receiver need distinct devices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from labrl.harness.models.device import make_current

DEFAULT_GROUP_TIMEOUT_S = 1800.0  # torch's default_pg_timeout, which SGLang's servers use


def init_custom_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
) -> Any:
    """A process group of ``world_size`` ranks outside the default group, rendezvous as SGLang's."""
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    # SGLang: "Use a PrefixStore to avoid accidental overrides of keys used by different systems"
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_custom_group(group: Any) -> None:
    """Release a group (and, with its last reference, the TCPStore rank 0 hosts)."""
    if group is not None:
        dist.destroy_process_group(group)


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[range]:
    """Consecutive index ranges whose summed sizes stay within ``bucket_bytes``.

    Order is kept (the receiver matches broadcasts by position); a tensor
    larger than a bucket forms a bucket of its own; no bucket is empty.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    out: list[range] = []
    start, filled = 0, 0
    for i, size in enumerate(sizes):
        if i > start and filled + size > bucket_bytes:
            out.append(range(start, i))
            start, filled = i, 0
        filled += size
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


class WeightBroadcaster:
    """The trainer's end (rank 0): ``SGLangSampler(..., broadcaster=WeightBroadcaster())``."""

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = (
            torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.group: Any = None
        self.groups_built = 0

    def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    ) -> None:
        self.destroy()
        self.group = init_custom_group(
            master_address=master_address,
            master_port=master_port,
            rank=0,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=timeout_s,
        )
        self.groups_built += 1

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> None:
        if self.group is None:
            raise RuntimeError("broadcast before init_group")
        for t in tensors:
            dist.broadcast(t.detach().to(self.device).contiguous(), src=0, group=self.group)

    def destroy(self) -> None:
        group, self.group = self.group, None
        destroy_custom_group(group)


def receive_device(backend: str, device: str | torch.device | None = None) -> torch.device:
    """Where a receiver allocates broadcast buffers: ``device`` if given, else the receiver
    process's first GPU for NCCL (which moves CUDA tensors only), the CPU for gloo."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")


class WeightReceiver:
    """A server's end (the fake server's; SGLang has its own), in a child process.

    The group lives in a spawned process, as on a server (whose GPU workers
    are processes of their own): torch refuses two groups of one name in a
    process, so a fake server in the trainer's process could not otherwise
    join the trainer's group under SGLang's name.
    """

    def __init__(
        self, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S, device: str | torch.device | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self.device = device  # None: receive_device(backend)
        self._proc: Any = None
        self._conn: Any = None

    def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        import multiprocessing as mp

        self.destroy()
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        spec = dict(
            master_address=master_address,
            master_port=master_port,
            rank=rank,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=self.timeout_s,
            device=str(receive_device(backend, self.device)),
        )
        self._proc = ctx.Process(target=_receiver_main, args=(child, spec), daemon=True)
        self._proc.start()
        child.close()
        self._answer()

    def _answer(self) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError("the weight receiver process died") from None
        if status == "error":
            raise RuntimeError(value)
        return value

    def receive(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        load: Callable[[list[tuple[str, torch.Tensor]]], Any],
    ) -> Any:
        """Receive one bucket (one broadcast per name, in order), then ``load`` it, as SGLang does."""
        if self._conn is None:
            raise RuntimeError("init_weights_update_group was not called")
        self._conn.send(("receive", names, dtypes, shapes))
        tensors = self._answer()
        return load(list(zip(names, tensors, strict=True)))

    def destroy(self) -> None:
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if proc is None:
            return
        try:
            conn.send(("stop",))
        except OSError:
            pass
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


def _receiver_main(conn: Any, spec: dict) -> None:
    """Child process: join the group, then receive buckets until told to stop."""
    torch.set_num_threads(1)
    spec = dict(spec)
    device = torch.device(spec.pop("device"))
    try:
        make_current(device)  # NCCL binds the group to the current device
        group = init_custom_group(**spec)
    except Exception as exc:  # the caller turns it into SGLang's "Failed to initialize ..." answer
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "stop":
            break
        _kind, _names, dtypes, shapes = msg
        try:
            out = []
            for dtype, shape in zip(dtypes, shapes, strict=True):
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                dist.broadcast(t, src=0, group=group)
                out.append(t.cpu())  # through the pipe as host tensors
            conn.send(("ok", out))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    destroy_custom_group(group)
