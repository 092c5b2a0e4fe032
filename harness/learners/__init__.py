"""Learners: train the policy from TrainBatches (``labrl.harness.types.Learner``)."""

from labrl.harness.learners.config import LearnerConfig, OptimizerConfig
from labrl.harness.learners.megatron import MegatronLearner

__all__ = ["LearnerConfig", "MegatronLearner", "OptimizerConfig"]
