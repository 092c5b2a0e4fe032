"""The ``ray:`` section of the run config: where the actors of a ``backend=ray`` run go.

::

    labrl train configs/quickstart.yaml backend=ray ray.address=auto ray.env_workers=4

Resources are Ray's logical resources: ``CPU``/``GPU`` per actor and any custom
resource a node was started with (``ray start --resources='{"lab_credentials": 1}'``).
A resource no node has, or an actor no node can hold, is a ``PlacementError``
before anything starts (``placement.check_placement``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RaySection(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    address: str | None = Field(
        default=None,
        description="None: start a local Ray on this machine; 'auto': join the cluster of `ray start`; "
        "or host:port of the head",
    )
    num_cpus: int | None = Field(
        default=None, ge=1, description="CPUs of a local Ray started by the run (address unset); None: all"
    )
    env_workers: int = Field(default=2, ge=1, description="env worker actors (each runs many episodes)")
    cpus_per_env_worker: float = Field(default=1.0, ge=0.0)
    env_worker_resources: dict[str, float] = Field(
        default_factory=dict, description="custom resources per env worker, e.g. {lab_credentials: 1}"
    )
    samplers: int = Field(
        default=1, ge=1, description="sampler actors (local sampler, or one per SGLang URL)"
    )
    cpus_per_sampler: float = Field(default=1.0, ge=0.0)
    gpus_per_sampler: float = Field(default=0.0, ge=0.0)
    sampler_resources: dict[str, float] = Field(default_factory=dict)
    learner_cpus: float = Field(default=1.0, ge=0.0)
    learner_gpus: int = Field(
        default=0, ge=0, description="GPUs of the learner: a placement group of this many 1-GPU bundles"
    )
    learner_resources: dict[str, float] = Field(default_factory=dict)
    env_worker_max_restarts: int = Field(
        default=-1, ge=-1, description="restarts of each env worker actor (-1: unlimited)"
    )
    sampler_max_restarts: int = Field(default=-1, ge=-1, description="restarts of each sampler actor")
    placement_timeout_s: float = Field(
        default=120.0, gt=0, description="an actor or placement group not up within this fails the run"
    )
    reissue_timeout_s: float = Field(
        default=300.0, gt=0, description="give up re-issuing to a sampler actor that stays down this long"
    )
    generate_coalesce_s: float = Field(
        default=0.002,
        ge=0.0,
        description="an env worker sends the turns its episodes ask within this in one call",
    )
    spread_env_workers: bool = Field(
        default=True, description="SPREAD env workers over nodes (a node loss takes fewer of them)"
    )
