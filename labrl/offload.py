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
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing as mp
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from typing import Any, Final, TypeVar

from labrl.errors import ConfigError, EnvError, EnvTimeoutError

T = TypeVar("T")

_MP_CONTEXT: Final = "forkserver"
_pool: ProcessPoolExecutor | None = None
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
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ProcessPoolExecutor(
                max_workers=_default_workers(), mp_context=mp.get_context(_MP_CONTEXT)
            )
        return _pool


def shutdown_cpu_pool(*, terminate: bool = False) -> None:
    """Shut the shared pool down (queued work cancelled; running work finishes in the background).

    ``terminate=True`` also stops the worker processes now (SIGTERM, then SIGKILL after 5 s) and
    the forkserver they were forked from, so a process that exits (a server on SIGTERM) leaves no
    pool process behind: workers forked by the forkserver are not our children and would
    otherwise outlive us as orphans.
    """
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        workers = list((getattr(pool, "_processes", None) or {}).values())  # CPython keeps them here
        pool.shutdown(wait=False, cancel_futures=True)
        if terminate:
            for worker in workers:
                if worker.is_alive():
                    worker.terminate()
            for worker in workers:
                worker.join(timeout=5)
                if worker.is_alive():
                    worker.kill()
                    worker.join(timeout=5)
    if terminate:
        _stop_forkserver()


def _stop_forkserver() -> None:
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)  # private, present in CPython 3.8+
    if stop is not None:
        stop()


atexit.register(shutdown_cpu_pool)


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
