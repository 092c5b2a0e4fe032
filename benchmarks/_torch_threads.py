"""The ``--threads`` option of the torch benchmarks: torch's intra-op threads for the whole run; and
``one_thread_on_cpu``, one intra-op thread for a block timed as a GPU step's host side.

Imported by the scripts beside it (``python benchmarks/<script>.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch


def parse_with_threads(parser: argparse.ArgumentParser, *, default: int) -> argparse.Namespace:
    """Add ``--threads`` (default ``default``) to ``parser``, parse the command line and set torch's
    intra-op threads to it (a fixed count: timings on a shared machine stay comparable)."""
    parser.add_argument("--threads", type=int, default=default, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


@contextlib.contextmanager
def one_thread_on_cpu(device: torch.device) -> Iterator[None]:
    """On CPU one intra-op thread for the block (a GPU step's host side is one thread, and a fixed
    count keeps timings on a shared machine comparable), restored after; elsewhere nothing."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
