"""The lab gateway's transcripts on disk, so that a lost head node does not lose paid-for lab jobs.

The gateway keeps, per group and member, the turns an episode generated before
it asked the lab for an experiment (``transcripts``), and the lab keys it
used. In memory they survive a dead env worker, not the head node (the driver
and the gateway live there). Written here, in the run directory, before the
lab request goes out, they survive a crash of the whole run: the rerun resumes
from its checkpoint, the groups that were in flight are played again from
these transcripts, and their lab calls re-attach to the journaled jobs instead
of paying for new ones.

A group's rows are deleted once a checkpoint covers the group (its
trajectories are in that checkpoint's buffer, trained, or dropped), not when
the driver receives them: a crash between the two would otherwise replay the
group without them.

One SQLite file, written by one thread (``labrl.sqlite_thread.SqliteThread``: the
gateway actor's event loop must not wait on the disk), WAL so a crash
mid-write loses at most the write, ``synchronous=FULL`` so a ``put`` that
returned survives a power cut of the head node too.
"""

from __future__ import annotations

import pickle
import sqlite3
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from labrl.sqlite_thread import SqliteThread

if TYPE_CHECKING:
    from labrl.harness.backends.ray.transcripts import SavedTurn

FILE_NAME = "lab_transcripts.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS transcripts (
    grp INTEGER NOT NULL,
    member INTEGER NOT NULL,
    turns BLOB NOT NULL,
    PRIMARY KEY (grp, member)
);
CREATE TABLE IF NOT EXISTS lab_keys (
    grp INTEGER NOT NULL,
    lab_key TEXT NOT NULL,
    PRIMARY KEY (grp, lab_key)
);
"""

Transcripts = dict[int, dict[int, list["SavedTurn"]]]


def discard(path: str | Path) -> None:
    """Remove a store (a new run, not a resume: another run's transcripts under the same group
    indices must not be replayed). The driver does this before the gateway starts, so a gateway that
    Ray restarts mid-run reopens what it had."""
    path = Path(path)
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        file.unlink(missing_ok=True)


class TranscriptStore:
    """``put`` before each lab call, ``release`` once a checkpoint covers the group, ``load`` on start."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = SqliteThread(
            self.path,
            synchronous="FULL",
            setup=lambda conn: conn.executescript(_SCHEMA),
            thread_name="labrl-transcripts",
        )

    def load(self) -> tuple[Transcripts, dict[int, set[str]]]:
        """Everything held: transcripts per group and member, and the lab keys per group (blocking; at start)."""
        return self._db.call(_load)

    async def put(self, group: int, member: int, turns: Sequence[SavedTurn], key: str) -> None:
        """Durable before it returns: the caller sends the lab request only after this."""
        await self._db.run(_put, group, member, list(turns), key)

    async def release(self, groups: Iterable[int]) -> None:
        rows = [(g,) for g in groups]
        if rows:
            await self._db.run(_release, rows)

    def close(self) -> None:
        self._db.close()


def _load(conn: sqlite3.Connection) -> tuple[Transcripts, dict[int, set[str]]]:
    transcripts: Transcripts = {}
    for grp, member, blob in conn.execute("SELECT grp, member, turns FROM transcripts"):
        transcripts.setdefault(grp, {})[member] = pickle.loads(blob)
    keys: dict[int, set[str]] = {}
    for grp, key in conn.execute("SELECT grp, lab_key FROM lab_keys"):
        keys.setdefault(grp, set()).add(key)
    return transcripts, keys


def _put(conn: sqlite3.Connection, group: int, member: int, turns: list[SavedTurn], key: str) -> None:
    blob = pickle.dumps(turns, protocol=5)  # here, not on the loop: routed experts make turns large
    with conn:
        conn.execute("BEGIN")
        conn.execute(
            "INSERT OR REPLACE INTO transcripts (grp, member, turns) VALUES (?, ?, ?)", (group, member, blob)
        )
        conn.execute("INSERT OR IGNORE INTO lab_keys (grp, lab_key) VALUES (?, ?)", (group, key))


def _release(conn: sqlite3.Connection, rows: list[tuple[int]]) -> None:
    with conn:
        conn.execute("BEGIN")
        conn.executemany("DELETE FROM transcripts WHERE grp = ?", rows)
        conn.executemany("DELETE FROM lab_keys WHERE grp = ?", rows)
