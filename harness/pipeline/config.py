"""The orchestrator's config: the ``pipeline`` section of a run config."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from labrl.harness.identity import IDENTITY
from labrl.harness.pipeline.overlong import OverlongSection

Mode = Literal["sync", "one_step_off", "pipeline"]

# Upper bounds of sizes that are allocated or started up front: far above any machine's need, low
# enough that a typo (an extra zero, 1e9) is a ConfigError instead of an OOM or a hang.
MAX_CONCURRENT_EPISODES = 65_536
MAX_EVAL_SIZE = 100_000
MAX_TORCH_THREADS = 1024  # torch.set_num_threads(100000) raises SystemError


class PipelineSection(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Mode = "pipeline"
    batch_groups: int = Field(default=8, ge=1, le=65_536, description="groups (tasks) per learner step")
    group_size: int = Field(
        default=8, ge=2, le=4096, description="G: rollouts per task", json_schema_extra=IDENTITY
    )
    max_staleness: int = Field(
        default=4,
        ge=0,
        description="admission bound on learner-version lag (mode: pipeline; sync acts as 0, one_step_off as 1)",
    )
    max_concurrent_episodes: int = Field(
        default=256, ge=1, le=MAX_CONCURRENT_EPISODES, description="episodes running at once"
    )
    total_steps: int = Field(default=100, ge=1, le=10**8)
    dynamic_sampling: bool = Field(default=True, description="drop zero-variance groups and oversample")
    retry_all_wrong: int = Field(
        default=0,
        ge=0,
        le=16,
        description="play a task whose group was all wrong (and dropped) again, up to this many times",
    )
    invalid_action_reward: float | None = Field(
        default=None,
        ge=-1.0,
        le=0.0,
        description="training reward of an episode that ends on an invalid action (None: the env's own); "
        "below 0 ranks an answer naming no allowed option under a wrong one (harness/pipeline/shaping.py)",
    )
    max_oversample_factor: float = Field(
        default=8.0, ge=1.0, description="stop if more than this many groups per needed group were dropped"
    )
    overlong: OverlongSection = Field(default_factory=OverlongSection)
    eval_every: int = Field(default=10, ge=0, description="0 disables periodic evaluation")
    eval_size: int = Field(
        default=64,
        ge=1,
        le=MAX_EVAL_SIZE,
        description="test-split tasks per evaluation (at most max_concurrent_episodes run at once)",
    )
    eval_temperature: float = Field(default=0.0, ge=0.0)
    checkpoint_every: int = Field(
        default=0, ge=0, description="also checkpoint every N learner steps (0: step-based saving off)"
    )
    checkpoint_every_s: float = Field(
        default=300.0,
        ge=0.0,
        description="checkpoint after the first learner step that ends this many seconds after the last "
        "checkpoint (0: time-based saving off); a SIGKILL loses at most this much training",
    )
    torch_threads: int = Field(
        default=1, ge=1, le=MAX_TORCH_THREADS, description="intra-op threads for each of learner and sampler"
    )
    episode_traces: bool = Field(
        default=True,
        description="write one line per episode (timings, versions, fate) to RUN_DIR/episodes.jsonl (docs/planning.md)",
    )
    progress: bool = True

    @property
    def effective_max_staleness(self) -> int:
        """The staleness bound the orchestrator admits under: ``sync`` 0, ``one_step_off`` 1,
        ``pipeline`` ``max_staleness``."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)

    @model_validator(mode="after")
    def _fit(self) -> PipelineSection:
        if self.group_size > self.max_concurrent_episodes:
            raise ValueError(
                f"pipeline.group_size={self.group_size} exceeds pipeline.max_concurrent_episodes="
                f"{self.max_concurrent_episodes}: a group's episodes run at once; raise max_concurrent_episodes"
            )
        if self.retry_all_wrong and not self.dynamic_sampling:
            raise ValueError(
                f"pipeline.retry_all_wrong={self.retry_all_wrong} needs pipeline.dynamic_sampling: true; "
                "with it off an all-wrong group is trained (zero advantage), never dropped, so never retried"
            )
        return self
