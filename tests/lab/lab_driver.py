"""A client process for the SIGKILL test: runs N echo jobs through a JournaledLab.

Usage: python lab_driver.py URL JOURNAL OUT N
Appends "key<TAB>fresh|replay" to OUT for every outcome, flushing each line.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from lab_clients import JOURNAL_CONFIG, fast_retry_client  # tests/support, on PYTHONPATH

from labrl.lab_adapters.job_journal import Journal
from labrl.lab_adapters.journaled_lab import JournaledLab


async def main(url: str, journal_path: str, out: str, n: int) -> None:
    adapter = fast_retry_client(url, call_timeout_s=2.0, long_poll_s=1.0)
    journal = Journal(journal_path)
    lab = JournaledLab(adapter, journal, JOURNAL_CONFIG)
    with open(out, "a") as sink:

        async def one(i: int) -> None:
            outcome = await lab.run({"kind": "echo", "payload": {"i": i}}, f"job-{i}")
            assert outcome.status.result == {"echo": {"i": i}, "digest": outcome.status.result["digest"]}
            sink.write(f"{outcome.key}\t{'fresh' if outcome.fresh else 'replay'}\n")
            sink.flush()

        await asyncio.gather(*(one(i) for i in range(n)))
    print(dict(lab.stats), flush=True)
    await lab.aclose()
    await adapter.aclose()
    await journal.close()


if __name__ == "__main__":
    # retries and give-ups under injected faults are expected here; only errors are worth printing
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
