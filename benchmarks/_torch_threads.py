"""The ``--threads`` option of the torch benchmarks: torch's intra-op threads for the whole run.

Imported by the scripts beside it (``python benchmarks/<script>.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import argparse

import torch


def parse_with_threads(parser: argparse.ArgumentParser, *, default: int) -> argparse.Namespace:
    """Add ``--threads`` (default ``default``) to ``parser``, parse the command line and set torch's
    intra-op threads to it (a fixed count: timings on a shared machine stay comparable)."""
    parser.add_argument("--threads", type=int, default=default, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args
