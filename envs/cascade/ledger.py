"""The budget ledger: what each cascade stage has been charged, refusing to go beyond its budget.

Every paid stage call has a key, ``env/split/seed/task/stage/candidate-hash``
(``labrl.envs.cascade.env.stage_key``), and goes through two calls:

1. ``pay(key, stage)`` before the stage runs: in one transaction, a key already in the ledger is
   returned as it is (``charged = 0``; its stored value, if any) and a new key is charged the
   stage's declared ``cost`` unless that would take the stage's total beyond its budget, which
   raises ``BudgetExhaustedError`` and charges nothing;
2. ``settle(key, value, seconds)`` once the stage answered: the value is stored once per key.

So nothing is charged twice, after a crash or when two episodes of a group submit the same
candidate: a key with a stored value is answered from the ledger without running the stage; a key
charged but never settled (the process died while the stage ran) runs the stage again on the
next request, without a second charge (for a lab stage the job journal keeps the lab from running
the experiment twice). The charge is the stage's declared cost per call, known before anything is
spent, so a refusal comes before the money goes.

``SqliteLedger`` persists the ledger like the job journal (``labrl.sqlite_thread``: WAL, one
thread that owns the connection, so the event loop never waits on the disk; ``BEGIN IMMEDIATE``
makes the check and the charge one step across processes sharing the file). ``MemoryLedger``
keeps it in the process (``cascade.ledger_path`` unset): the same rules, lost with the process.
"""

from __future__ import annotations

import sqlite3
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from labrl.envs.cascade.config import StageBudget
from labrl.envs.cascade.stages import Stage
from labrl.errors import BudgetExhaustedError, ConfigError
from labrl.sqlite_thread import SqliteThread


@dataclass(frozen=True)
class Payment:
    key: str
    charged: float  # 0 when the key had been paid before
    value: float | None  # the stored value of a key paid and settled before


def refuse_beyond_budget(stage: Stage, spent: float, budget: StageBudget | None) -> None:
    """``BudgetExhaustedError`` when charging ``stage.cost`` on top of ``spent`` would pass ``budget``."""
    if budget is None or spent + stage.cost <= budget.limit:
        return
    raise BudgetExhaustedError(
        f"cascade stage {stage.name!r}: {spent:g} of its {budget.limit:g} {budget.unit.value} budget "
        f"is spent and a call costs {stage.cost:g}: raise cascade.budgets.{stage.name}.limit to go on"
    )


class BudgetLedger(ABC):
    """See the module docstring."""

    def __init__(self, budgets: Mapping[str, StageBudget]) -> None:
        self.budgets = dict(budgets)

    @abstractmethod
    async def pay(self, key: str, stage: Stage) -> Payment: ...

    @abstractmethod
    async def settle(self, key: str, value: float, seconds: float) -> None: ...

    @abstractmethod
    async def spent(self) -> dict[str, float]:
        """Total charged per stage name."""

    async def close(self) -> None:
        return None


class MemoryLedger(BudgetLedger):
    def __init__(self, budgets: Mapping[str, StageBudget]) -> None:
        super().__init__(budgets)
        self._charged: dict[str, tuple[str, float]] = {}  # key -> (stage, cost)
        self._values: dict[str, float] = {}
        self._totals: dict[str, float] = {}

    async def pay(self, key: str, stage: Stage) -> Payment:
        # no await between the check and the charge: two episodes on the loop cannot both pass the check
        if key in self._charged:
            _check_same_stage(key, self._charged[key][0], stage)
            return Payment(key, 0.0, self._values.get(key))
        spent = self._totals.get(stage.name, 0.0)
        refuse_beyond_budget(stage, spent, self.budgets.get(stage.name))
        self._charged[key] = (stage.name, stage.cost)
        self._totals[stage.name] = spent + stage.cost
        return Payment(key, stage.cost, None)

    async def settle(self, key: str, value: float, seconds: float) -> None:
        self._values.setdefault(key, value)

    async def spent(self) -> dict[str, float]:
        return dict(self._totals)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS charges (
    key TEXT PRIMARY KEY,
    stage TEXT NOT NULL,
    cost REAL NOT NULL,
    value REAL,
    seconds REAL,
    charged_at REAL NOT NULL,
    settled_at REAL
);
CREATE INDEX IF NOT EXISTS charges_stage ON charges (stage);
"""


class SqliteLedger(BudgetLedger):
    def __init__(self, path: str | Path, budgets: Mapping[str, StageBudget]) -> None:
        super().__init__(budgets)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = SqliteThread(
                self.path, synchronous="NORMAL", setup=_create, thread_name="labrl-cascade-ledger"
            )
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"cascade.ledger_path {self.path}: not a usable ledger ({exc})") from exc

    async def close(self) -> None:
        await self._db.aclose()

    async def pay(self, key: str, stage: Stage) -> Payment:
        budget = self.budgets.get(stage.name)

        def write(conn: sqlite3.Connection) -> Payment:
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = conn.execute("SELECT stage, value FROM charges WHERE key = ?", (key,)).fetchone()
                if row is not None:
                    _check_same_stage(key, row[0], stage)
                    return Payment(key, 0.0, row[1])
                (spent,) = conn.execute(
                    "SELECT COALESCE(SUM(cost), 0) FROM charges WHERE stage = ?", (stage.name,)
                ).fetchone()
                refuse_beyond_budget(stage, float(spent), budget)
                conn.execute(
                    "INSERT INTO charges (key, stage, cost, charged_at) VALUES (?, ?, ?, ?)",
                    (key, stage.name, stage.cost, time.time()),
                )
                return Payment(key, stage.cost, None)
            finally:
                conn.execute("COMMIT")

        return await self._db.run(write)

    async def settle(self, key: str, value: float, seconds: float) -> None:
        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                "UPDATE charges SET value = ?, seconds = ?, settled_at = ? WHERE key = ? AND value IS NULL",
                (value, seconds, time.time(), key),
            )

        await self._db.run(write)

    async def spent(self) -> dict[str, float]:
        def read(conn: sqlite3.Connection) -> dict[str, float]:
            return dict(conn.execute("SELECT stage, SUM(cost) FROM charges GROUP BY stage").fetchall())

        return await self._db.run(read)


def _create(conn: sqlite3.Connection) -> None:
    conn.executescript(_SCHEMA)


def _check_same_stage(key: str, recorded: str, stage: Stage) -> None:
    if recorded != stage.name:
        raise ValueError(f"ledger key {key!r} was charged to stage {recorded!r}, not {stage.name!r}")
