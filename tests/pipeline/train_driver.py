"""``labrl`` in a subprocess with the fake letter env registered (the kill tests signal this process)."""

from __future__ import annotations

import sys

from labrl.envs import register

register("test/letter-v0", entry_point="pipeline_fakes:LetterEnv")

from labrl.cli import main  # noqa: E402

raise SystemExit(main(sys.argv[1:]))
