"""Named concurrency pools shared by every episode in the process.

An env declares ``Budgets(pools={"lab": 4})`` and wraps its expensive calls in
``async with env.pool("lab"):``. All episodes in the process that name the
same pool share one semaphore, so a thousand concurrent episodes never put
more than four jobs on the lab at once.

Semaphores are bound to the event loop that first awaits them, so pools are
kept per running loop.
"""

from __future__ import annotations

import asyncio
import weakref

from labrl.errors import ConfigError

_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, tuple[int, asyncio.Semaphore]]] = (
    weakref.WeakKeyDictionary()
)


def get_pool(name: str, size: int) -> asyncio.Semaphore:
    """The process-wide semaphore named ``name`` for the running loop.

    Two envs that declare the same pool must agree on its size; a mismatch is
    a config error (the second would otherwise be silently ignored).
    """
    loop = asyncio.get_running_loop()
    pools = _POOLS.setdefault(loop, {})
    if name in pools:
        existing_size, semaphore = pools[name]
        if existing_size != size:
            raise ConfigError(
                f"concurrency pool {name!r} is declared with size {size} but already exists with size "
                f"{existing_size}: give every env that shares the pool the same size"
            )
        return semaphore
    semaphore = asyncio.Semaphore(size)
    pools[name] = (size, semaphore)
    return semaphore
