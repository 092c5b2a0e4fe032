"""What a process has used so far, read from Linux's ``/proc`` (no psutil in labrl's venv).

Imported by the scripts beside it, like ``_results.py``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far."""
    # the command name in parentheses may hold spaces: the fields are counted after its ")"
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` now (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line (a zombie process?)")
