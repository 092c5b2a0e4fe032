"""``labrl.sqlite_thread``: the shared WAL set-up, and one database thread for async stores."""

from __future__ import annotations

import asyncio
import sqlite3
import threading

import pytest

from labrl.sqlite_thread import BUSY_TIMEOUT_MS, SqliteThread, connect_wal

SYNCHRONOUS_LEVEL = {"NORMAL": 1, "FULL": 2}  # what PRAGMA synchronous reads back


def _pragmas(conn: sqlite3.Connection) -> tuple[str, int, int]:
    return tuple(
        conn.execute(f"PRAGMA {name}").fetchone()[0]
        for name in ("journal_mode", "synchronous", "busy_timeout")
    )


@pytest.mark.parametrize("synchronous", ["NORMAL", "FULL"])
def test_connect_wal_sets_the_shared_pragmas(tmp_path, synchronous):
    conn = connect_wal(tmp_path / "db.sqlite", synchronous=synchronous)
    try:
        assert _pragmas(conn) == ("wal", SYNCHRONOUS_LEVEL[synchronous], BUSY_TIMEOUT_MS)
        assert conn.isolation_level is None  # autocommit: stores open their transactions with BEGIN
    finally:
        conn.close()


async def test_calls_run_in_order_on_one_thread_that_is_not_the_loops(tmp_path):
    db = SqliteThread(
        tmp_path / "db.sqlite",
        synchronous="FULL",
        setup=lambda conn: conn.execute("CREATE TABLE t (n INTEGER)"),
        thread_name="labrl-test-db",
    )
    threads: set[str] = set()

    def insert(conn: sqlite3.Connection, n: int) -> None:
        threads.add(threading.current_thread().name)
        conn.execute("INSERT INTO t VALUES (?)", (n,))

    await asyncio.gather(*(db.run(insert, n) for n in range(20)))
    assert db.call(lambda conn: [n for (n,) in conn.execute("SELECT n FROM t ORDER BY rowid")]) == list(
        range(20)
    )
    assert await db.run(_pragmas) == ("wal", SYNCHRONOUS_LEVEL["FULL"], BUSY_TIMEOUT_MS)
    assert len(threads) == 1 and threads.pop().startswith("labrl-test-db")
    await db.aclose()
    with pytest.raises(RuntimeError, match="shutdown"):
        db.call(_pragmas)


def test_a_failing_setup_raises_and_leaves_no_thread(tmp_path):
    before = threading.active_count()
    with pytest.raises(sqlite3.OperationalError, match="syntax error"):
        SqliteThread(tmp_path / "db.sqlite", synchronous="NORMAL", setup=lambda conn: conn.execute("NOT SQL"))
    assert threading.active_count() == before
