"""Run work off the event loop: CPU-heavy work in a process pool, hang-prone
work in a killable subprocess with a deadline. Shared by envs, verifiers and
lab adapters, so it lives at the namespace root (no layer imports upward).

One slow episode must never stall the thousands of others sharing the loop:

- ``run_cpu(fn, *args)``: a shared ``ProcessPoolExecutor`` (forkserver, so
  workers start from a clean interpreter rather than a fork of a process that
  holds torch threads and sockets). ``fn`` must be importable at module level.
- ``run_killable(fn, *args, timeout=...)``: a fresh subprocess per call; at
  the deadline it is killed (SIGKILL) and ``EnvTimeoutError`` is raised. Use
  it for code that can hang in C (a DFT SCF loop, a solver) where a thread or
  a pool worker could not be stopped.

Scripts: the forkserver re-imports the script that was run (``__main__``)
in each new worker, as ``spawn`` does, so a script that runs episodes must
keep that code under ``if __name__ == "__main__":``. Without the guard the
re-import is caught (``ConfigError`` in the worker, ``EnvError`` naming the
fix in the caller) instead of starting episodes again in every worker.

Exceptions raised by ``fn`` are re-raised in the caller unchanged (labrl's
errors are picklable); a worker that dies without answering gives ``EnvError``.

Exit: work still running in the pool when the process exits is abandoned. Its
workers and the forkserver are ended before ``concurrent.futures`` joins the
pool's manager thread, so a busy or stuck pool cannot hold the exit (a stopped
``labrl train`` exits within seconds of its summary).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from typing import Any, Final, TypeVar

from labrl.errors import ConfigError, EnvError, EnvTimeoutError

T = TypeVar("T")

_MP_CONTEXT: Final = "forkserver"
STOP_GRACE_S: Final = 2.0  # a pool being ended: SIGTERM -> SIGKILL, and the wait for its manager thread
_pool: ProcessPoolExecutor | None = None
_pool_pid: int | None = None  # the process that created _pool (a fork inherits the reference, not the pool)
_pool_lock = threading.Lock()


def _default_workers() -> int:
    return max(1, int(os.environ.get("LABRL_CPU_WORKERS", os.cpu_count() or 1)))


MAIN_GUARD_HINT = (
    "labrl's process pool (forkserver) re-imports the script you ran in each new worker, as "
    "multiprocessing's spawn does; code that runs episodes must sit under "
    '`if __name__ == "__main__":` (see docs/hardening.md)'
)


def _in_reimported_script() -> bool:
    """True in a forkserver or worker re-importing the user's script (runpy runs it as ``__mp_main__``)."""
    # During the re-import runpy holds the script as sys.modules["__mp_main__"]; once it is done,
    # multiprocessing installs it as __main__ too. A child that finished preparing may use the pool.
    reimported = sys.modules.get("__mp_main__")
    return reimported is not None and sys.modules.get("__main__") is not reimported


def cpu_pool() -> ProcessPoolExecutor:
    """The process-wide pool for CPU-heavy env work (created on first use)."""
    if _in_reimported_script():
        raise ConfigError(
            f"an unguarded script started labrl work while being re-imported: {MAIN_GUARD_HINT}"
        )
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None:
            _pool = ProcessPoolExecutor(
                max_workers=_default_workers(), mp_context=mp.get_context(_MP_CONTEXT)
            )
            _pool_pid = os.getpid()
        return _pool


def shutdown_cpu_pool(*, terminate: bool = False) -> None:
    """Shut the shared pool down (queued work cancelled; running work finishes in the background).

    ``terminate=True`` also ends the worker processes now (SIGTERM, then SIGKILL after
    ``STOP_GRACE_S``) and the forkserver they were forked from, then waits up to ``STOP_GRACE_S``
    for the pool's manager thread. Workers forked by the forkserver are not our children and
    would otherwise outlive us as orphans; a busy or dead-but-unreaped worker would otherwise keep
    the manager thread, and so interpreter exit, waiting for ever (see ``_end_pool_at_exit``).
    """
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    manager: threading.Thread | None = None
    if pool is not None:
        # CPython keeps these on the executor, and shutdown() drops its references to them
        workers = list((getattr(pool, "_processes", None) or {}).values())
        manager = getattr(pool, "_executor_manager_thread", None)
        pool.shutdown(wait=False, cancel_futures=True)
        if terminate:
            _let_manager_drop_cancelled_work(pool, manager)
            _end_processes(workers)
    if terminate:
        _stop_forkserver()
        if manager is not None:
            manager.join(timeout=STOP_GRACE_S)


def _let_manager_drop_cancelled_work(pool: ProcessPoolExecutor, manager: threading.Thread | None) -> None:
    """Wait (at most ``STOP_GRACE_S``) until the manager thread has handled ``shutdown(cancel_futures=True)``.

    CPython 3.11's manager clears ``_cancel_pending_futures`` once it has dropped the cancelled work
    items (``flag_executor_shutting_down``). Killing workers before that sends it to
    ``terminate_broken``, whose ``set_exception`` on an already-cancelled future raises
    ``InvalidStateError`` in the thread (caught there only from 3.12 on).
    """
    deadline = time.monotonic() + STOP_GRACE_S
    while (
        manager is not None
        and manager.is_alive()
        and getattr(pool, "_cancel_pending_futures", False)
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)


def _end_processes(processes: list[Any]) -> None:
    """SIGTERM every live process, SIGKILL whichever has not ended after ``STOP_GRACE_S`` in all."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():  # also a worker that died but that a stuck forkserver never reaped
            process.kill()


def _stop_forkserver() -> None:
    """Kill the forkserver, then let multiprocessing forget it (the next pool starts a new one).

    Killing rather than asking: ``_stop`` closes the forkserver's "alive" pipe and waits without a
    limit for it to exit, which a forkserver blocked elsewhere never does. Its death also closes
    the write end of every worker's sentinel pipe (CPython 3.11 ``popen_forkserver``: the sentinel
    is the pipe on which the forkserver reports the worker's exit code), so a pool manager thread
    waiting in ``wait_result_broken_or_wakeup`` on the sentinel of a worker the forkserver never
    reaped wakes up, finds the pool broken and ends (``terminate_broken``).
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)  # private, present in CPython 3.8+
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):  # it may have ended already
        os.kill(pid, signal.SIGKILL)
    server._stop()  # type: ignore[attr-defined]


def _end_pool_at_exit() -> None:
    """At interpreter exit, end the pool before ``concurrent.futures`` joins its manager thread.

    CPython 3.11's ``concurrent.futures.process`` registers ``_python_exit`` with
    ``threading._register_atexit``: at exit it wakes each pool's manager thread and joins it with no
    limit; a manager with running work waits for that work (or for a worker the forkserver never
    reaped) for ever. ``threading._shutdown`` calls these hooks in reverse order of registration, and
    this module imported ``concurrent.futures.process`` (registering its hook) before registering
    this one, so the workers are already ended when that join runs. A plain ``atexit`` hook runs
    only after threads are joined: too late. A forked child that inherited the reference leaves
    its parent's pool and forkserver alone.
    """
    if _pool is not None and _pool_pid == os.getpid():
        shutdown_cpu_pool(terminate=True)


threading._register_atexit(_end_pool_at_exit)  # type: ignore[attr-defined]


async def run_cpu(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` in the shared process pool without blocking the loop."""
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(cpu_pool(), partial(fn, *args, **kwargs))
    except BrokenProcessPool as exc:
        shutdown_cpu_pool()  # a broken pool refuses all further work: the next call starts a new one
        raise EnvError(
            f"a process-pool worker died ({exc}); killed for memory, or, when running a script: {MAIN_GUARD_HINT}"
        ) from exc


def _child_main(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        conn.send(("ok", fn(*args, **kwargs)))
    except BaseException as exc:  # sent to the parent, which re-raises it
        try:
            conn.send(("error", exc))
        except Exception:  # the exception itself does not pickle
            conn.send(("error", EnvError(f"{type(exc).__name__}: {exc}")))
    finally:
        conn.close()


async def run_killable(fn: Callable[..., T], *args: Any, timeout: float, **kwargs: Any) -> T:
    """Run ``fn`` in its own subprocess; kill it and raise ``EnvTimeoutError`` after ``timeout`` s."""
    ctx = mp.get_context(_MP_CONTEXT)
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child_main, args=(child_conn, fn, args, kwargs), daemon=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, process.start)  # forkserver start is a blocking round-trip
    child_conn.close()

    readable: asyncio.Future[None] = loop.create_future()
    fd = parent_conn.fileno()

    def on_readable() -> None:
        if not readable.done():
            readable.set_result(None)

    loop.add_reader(fd, on_readable)
    try:
        try:
            async with asyncio.timeout(timeout):
                await readable
        except TimeoutError:
            process.kill()
            raise EnvTimeoutError(
                f"{getattr(fn, '__name__', fn)!s} did not finish within {timeout:g} s; killed"
            ) from None
        try:
            status, payload = parent_conn.recv()
        except EOFError:
            await loop.run_in_executor(None, process.join, 5.0)
            raise EnvError(
                f"{getattr(fn, '__name__', fn)!s} died without a result (exit code {process.exitcode})"
            ) from None
    finally:
        loop.remove_reader(fd)
        parent_conn.close()
        if process.is_alive():
            process.kill()
        await loop.run_in_executor(None, process.join, 5.0)
    if status == "error":
        raise payload
    return payload
