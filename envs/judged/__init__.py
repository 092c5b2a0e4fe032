"""labrl.envs.judged: rubric-judged environments (``judged/science-qa-v0``)."""

from labrl.envs.judged.env import ScienceQAConfig, ScienceQAEnv
from labrl.envs.judged.tasks import QATask, load_tasks, parse_tasks

__all__ = ["QATask", "ScienceQAConfig", "ScienceQAEnv", "load_tasks", "parse_tasks"]
