"""The lab gateway: one actor on the head node that owns the lab connection and its journal.

Env workers come and go (restarts, lost nodes); the record of what was paid
for must not. So under ``backend=ray`` no env worker talks to a lab: each
process installs ``GatewayConnection`` as the lab envs' connection
(``labrl.envs.lab.session.use_connection_factory``) and every experiment is a
call to the gateway, which runs it through the one ``JournaledLab`` (journal
committed before the request goes out, idempotency keys, exactly-once
delivery) exactly as an in-process run does.

The call carries the episode's transcript (``transcripts``): the gateway keeps
it until the driver has the group's trajectories (``release``), so a group
replayed after its worker died resumes the episodes that had a lab job from
their transcripts and re-attaches to those jobs (the journal and the lab see
the same idempotency key; ``JournaledLab`` joins the running driver of the key
or returns its delivered result).

What a head-node loss costs: Ray's control store (GCS) is on the head, so the
cluster and the run stop. The journal is a file (``journal_path`` of the lab
env, default ``runs/lab/journal.sqlite`` on the head's disk), and so are the
transcripts (``transcript_store``: ``RUN_DIR/lab_transcripts.sqlite``, written
before the lab request goes out). The rerun resumes from the last checkpoint;
the groups in flight are played again from their transcripts and
``JournaledLab`` re-attaches to their jobs: nothing paid for is lost, unless
the head's disk is lost too (put the run directory and the journal on shared
storage against that).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from labrl.envs.lab.session import LabSettings, connection, open_connections
from labrl.harness.backends.ray.transcript_store import TranscriptStore
from labrl.harness.backends.ray.transcripts import SavedTurn, current_group
from labrl.harness.rollout.play import current_member


class LabGateway:
    """The actor's body (``ray.remote(LabGateway)``); plain methods, unit-testable without Ray."""

    def __init__(self, store_path: str | None = None) -> None:
        """``store_path``: where the transcripts are kept on disk (``transcript_store``; what is there
        is loaded: a resumed run's, or this run's when Ray restarts the gateway); None: memory only."""
        self.store = TranscriptStore(store_path) if store_path is not None else None
        self.transcripts: dict[int, dict[int, list[SavedTurn]]] = {}
        self.group_keys: dict[int, set[str]] = {}
        if self.store is not None:
            self.transcripts, self.group_keys = self.store.load()
        self.counters: Counter[str] = Counter()
        self.pending = 0  # lab calls waiting on their job right now

    async def run(
        self,
        settings: LabSettings,
        request: dict[str, Any],
        key: str,
        group: int | None = None,
        member: int | None = None,
        transcript: Sequence[SavedTurn] | None = None,
        resumed: bool = False,
    ) -> Any:
        """Run one experiment through the journaled lab; keep the episode's transcript first."""
        if group is not None and member is not None and transcript is not None:
            self.transcripts.setdefault(group, {})[member] = list(transcript)
            keys = self.group_keys.setdefault(group, set())
            if resumed and key in keys:
                self.counters["jobs_reattached"] += 1
            keys.add(key)
            if self.store is not None:  # on disk before the lab request goes out
                await self.store.put(group, member, transcript, key)
        self.counters["lab_calls"] += 1
        self.pending += 1
        try:
            conn = await connection(settings)
            return await conn.lab.run(request, key)
        finally:
            self.pending -= 1

    async def saved(self, group: int) -> dict[int, list[SavedTurn]]:
        """The transcripts kept for ``group`` (member -> turns); empty when none had a lab job."""
        return dict(self.transcripts.get(group, {}))

    async def held(self) -> list[int]:
        """The groups with transcripts (after a restart of the run: those to resume, not re-run)."""
        return sorted(self.transcripts)

    async def release(self, groups: Sequence[int]) -> None:
        """A checkpoint covers these groups' trajectories: their transcripts are no longer needed."""
        for g in groups:
            self.transcripts.pop(g, None)
            self.group_keys.pop(g, None)
        if self.store is not None:
            await self.store.release(groups)

    async def stats(self) -> dict[str, Any]:
        """Gateway counters, the journaled labs' counters and, for the in-process mock lab, its own counts."""
        out: dict[str, Any] = dict(self.counters)
        out["transcripts_held"] = sum(len(v) for v in self.transcripts.values())
        out["lab_calls_pending"] = self.pending
        for conn in open_connections():
            for name, value in conn.lab.stats.items():
                out[f"journal/{name}"] = out.get(f"journal/{name}", 0) + value
            if conn.mock is not None:
                jobs = list(conn.mock.lab.store.jobs.values())
                out["mock/jobs"] = out.get("mock/jobs", 0) + len(jobs)
                out["mock/max_submits_per_job"] = max(
                    [out.get("mock/max_submits_per_job", 0)] + [j.submits for j in jobs]
                )
                out["mock/max_runs_per_job"] = max(
                    [out.get("mock/max_runs_per_job", 0)] + [j.runs for j in jobs]
                )
                out["mock/keys"] = out.get("mock/keys", 0) + len({j.key for j in jobs})
        return out

    async def ping(self) -> bool:
        return True


class _GatewayLab:
    """What a lab env calls (``conn.lab.run``), forwarded to the gateway actor with the episode's transcript."""

    def __init__(self, gateway: Any, settings: LabSettings) -> None:
        self.gateway = gateway
        self.settings = settings

    async def run(self, request: dict[str, Any], key: str) -> Any:
        group, member = current_group.get(), current_member.get()
        transcript = None
        resumed = False
        if group is not None and member is not None:
            transcript = list(group.turns.get(member, ()))
            resumed = group.resumed(member)
        ref = self.gateway.run.remote(
            self.settings,
            request,
            key,
            group.index if group is not None else None,
            member,
            transcript,
            resumed,
        )
        return await ref


class GatewayConnection:
    """Stands in for ``LabConnection`` in an env worker: only ``lab.run`` is used by the lab envs."""

    def __init__(self, gateway: Any, settings: LabSettings) -> None:
        self.lab = _GatewayLab(gateway, settings)
        self.mock = None

    async def aclose(self) -> None:
        return None


def gateway_factory(gateway: Any):
    """The connection factory to install in a process whose lab envs must go through ``gateway``."""

    async def factory(settings: LabSettings) -> GatewayConnection:
        return GatewayConnection(gateway, settings)

    return factory
