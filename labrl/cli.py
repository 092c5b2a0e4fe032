"""The ``labrl`` command line.

Each command group lives in its own module under ``labrl.commands`` and
exposes ``add_parser(subparsers)``, which registers its sub-commands and sets
``func(args) -> int`` on each. Groups are imported only when named, so
``labrl envs list`` does not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import warnings
from collections.abc import Sequence

from labrl._warnings import quiet_expected_warnings
from labrl.errors import LabrlError
from labrl.runtime import tune_gc_for_many_episodes

# group name -> (module, one-line help)
COMMAND_GROUPS: dict[str, tuple[str, str]] = {
    "envs": ("labrl.commands.envs", "list, show, sample and check environments"),
    "serve": ("labrl.commands.serve", "launch and supervise an inference server (sglang)"),
    "lab": (
        "labrl.commands.lab",
        "the mock lab (serve-mock); submit, status, journal: look at a lab by hand",
    ),
    "judge": ("labrl.commands.judge", "rubric judges: run the mock judge, validate rubric task files"),
    "train": ("labrl.commands.train", "train a policy on an env: labrl train CONFIG [key=value ...]"),
    "report": ("labrl.commands.report", "plots and a summary of a run: labrl report RUN_DIR"),
    "plan": (
        "labrl.commands.plan",
        "predicted steps/s and staleness of a few layouts: labrl plan CONFIG --from-run RUN_DIR",
    ),
    "xrd": ("labrl.commands.xrd", "powder XRD: labrl xrd identify PATTERN [--cif A.cif ...]"),
}


def build_parser(groups: Sequence[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="labrl", description="labrl: RL on high-latency scientific environments"
    )
    sub = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)
    for name in groups if groups is not None else COMMAND_GROUPS:
        module_name, _help = COMMAND_GROUPS[name]
        importlib.import_module(module_name).add_parser(sub)
    return parser


def _show_labrl_log_lines() -> None:
    """labrl's INFO lines (device, precision, layer spec at start) on stderr; other libraries' stay off."""
    logger = logging.getLogger("labrl")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _one_line_warning(message, category, filename, lineno, line=None) -> str:  # type: ignore[no-untyped-def]
    """Warnings on the console as one line each (the source line under them says nothing to a user)."""
    return f"labrl: warning: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
    quiet_expected_warnings()
    _show_labrl_log_lines()
    warnings.formatwarning = _one_line_warning
    argv = list(sys.argv[1:] if argv is None else argv)
    # Import only the named group: keeps `labrl envs list` fast.
    named = [argv[0]] if argv and argv[0] in COMMAND_GROUPS else None
    parser = build_parser(named)
    if named is None and argv and not argv[0].startswith("-"):
        parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMAND_GROUPS)}")
    args = parser.parse_args(argv)
    tune_gc_for_many_episodes()  # after imports: freezes them (labrl.runtime)
    try:
        return int(args.func(args) or 0)
    except LabrlError as exc:
        print(f"labrl: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _reader_went_away()
    except KeyboardInterrupt:  # Ctrl-C outside a command's own handling (imports, set-up)
        print("labrl: interrupted", file=sys.stderr)
        return 130


def _reader_went_away() -> int:
    """``labrl ... | head``: the reader closed the pipe. Stop quietly, as a killed-by-SIGPIPE tool does.

    stdout is pointed at /dev/null so the interpreter's final flush does not raise again.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    raise SystemExit(main())
