"""The machine figures ``labrl plan`` assumes without a run: read from the benchmarks' recorded results,
else from ``DEFAULTS``, the one table of values nobody has measured here, each with its source.

Read from ``benchmarks/results/`` (``load_figures``), when the file is there:

- ``gpu_*/gpu_learner.json`` (``benchmarks/gpu_learner.py``; each figure from the newest directory that
  measured it, newest by the date that ends the directory's name, then by name: a run of only some
  parts leaves the others' figures to older runs): the learner's tokens/s per GPU (the fastest
  ``labrl MegatronLearner.train_step`` row of the shape with the most active parameters: the experts
  module ``auto`` picks on a GPU is the faster one) and the local sampler's decode tokens/s per GPU
  (its batch-64 row on the quickstart shape, with the default ``megatron`` engine);
- ``learner_throughput.json`` (``benchmarks/learner_throughput.py``, the ``tiny-moe`` preset on CPU): the
  learner's and the local sampler's (fp32, batch 64) tokens/s on CPU;
- ``ray_scaling.json`` (``benchmarks/ray_scaling.py``): the driver's CPU milliseconds per episode at its
  most env workers (2.1 ms: a ceiling of ~480 episodes/s).

A figure measured on one shape is moved to the planned model as compute-bound work is:
``tokens/s x P_recorded / P_model``, ``P`` the active matmul parameters
(``MoEModelConfig.active_matmul_parameter_count``); optimistic for models smaller than the recorded one,
whose steps are launch-bound.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from labrl.errors import ConfigError
from labrl.harness.models.config import get_preset

#: the repository's recorded results (an editable install: labrl/ sits beside benchmarks/)
RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@dataclass(frozen=True)
class Figure:
    value: float
    unit: str
    source: str
    active_params: int = 0  # the shape it was measured on (throughput figures), 0: not shape-bound
    recorded: bool = False  # read from a benchmark's results, not DEFAULTS

    def for_model(self, active_params: int) -> float:
        """The figure moved to a model of ``active_params`` (module docstring); as is when not shape-bound."""
        return self.value * self.active_params / active_params if self.active_params else self.value


_TINY = get_preset("tiny-moe").active_matmul_parameter_count

DEFAULTS: dict[str, Figure] = {
    "learner_tokens_per_s_gpu": Figure(
        12_830, "tokens/s", "benchmarks/README.md, gpu_learner.py on one H100, 64 experts top-8", 334_495_744
    ),
    "learner_tokens_per_s_cpu": Figure(447, "tokens/s", "benchmarks/README.md, learner_throughput.py", _TINY),
    "local_sampler_tokens_per_s_gpu": Figure(
        4_271, "tokens/s", "benchmarks/README.md, gpu_learner.py, batch 64, quickstart model", 321_024
    ),
    "local_sampler_tokens_per_s_cpu": Figure(
        358, "tokens/s", "benchmarks/README.md, learner_throughput.py, fp32 batch 64", _TINY
    ),
    "sglang_tokens_per_s_gpu": Figure(
        20_000,
        "tokens/s",
        "assumed: the low end of the ~20-50k per GPU of benchmarks/README.md's Ray projection",
    ),
    "sglang_slots_per_gpu": Figure(256, "sequences", "assumed: SGLang's concurrent sequences per server"),
    "driver_s_per_episode": Figure(
        0.0021, "s", "benchmarks/README.md, ray_scaling.py: 2.1 ms CPU per episode (~480 episodes/s)"
    ),
    "env_step_median_s": Figure(
        1.0, "s", "assumed: benchmarks/pipeline.py's env (median 1 s); give --env-step-s"
    ),
    "env_step_sigma": Figure(
        1.288, "", "assumed: benchmarks/pipeline.py's env (p99/p50 = 20: sigma = ln 20 / 2.326)"
    ),
    "keep_rate": Figure(1.0, "", "assumed: every group kept; a run measures it (--from-run)"),
}


def load_figures(results_dir: Path | None = None) -> dict[str, Figure]:
    """``DEFAULTS`` with every figure the recorded results hold replaced by it (module docstring)."""
    results = RESULTS_DIR if results_dir is None else Path(results_dir)
    figures = dict(DEFAULTS)
    figures.update(_gpu_learner(results))
    figures.update(_cpu_learner(results))
    figures.update(_ray_scaling(results))
    return figures


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable benchmark result ({exc})") from None


def _recorded(key: str, value: float, source: str, active_params: int | None = None) -> Figure:
    params = DEFAULTS[key].active_params if active_params is None else active_params
    return replace(DEFAULTS[key], value=float(value), source=source, active_params=params, recorded=True)


def _gpu_results(results: Path) -> list[tuple[Path, dict]]:
    """Every ``gpu_*/gpu_learner.json`` with its GPU part, newest first (module docstring)."""

    def newest_first(path: Path) -> tuple[str, str]:
        dated = re.search(r"(\d{4}-\d{2}-\d{2})$", path.parent.name)
        return (dated.group(1) if dated else "", path.parent.name)

    out = []
    for path in sorted(results.glob("gpu_*/gpu_learner.json"), key=newest_first, reverse=True):
        data = _read(path)
        if data and "gpu" in data:
            out.append((path.relative_to(results), data["gpu"]))
    return out


def _learner_figure(where: Path, gpu: dict) -> Figure | None:
    shapes = sorted(gpu.get("shapes", {}).items(), key=lambda kv: kv[1]["active_matmul_params"])
    for name, shape in reversed(shapes):
        measured = [r for r in shape["rows"] if r["path"].startswith("labrl") and "tokens_per_s" in r]
        if measured:
            row = max(measured, key=lambda r: r["tokens_per_s"])
            return _recorded(
                "learner_tokens_per_s_gpu",
                row["tokens_per_s"],
                f"{where}: {row['path']}, {name}, {gpu.get('device', 'GPU')}",
                shape["active_matmul_params"],
            )
    return None


def _sampler_figure(where: Path, gpu: dict) -> Figure | None:
    sampler = next(
        (
            r
            for r in gpu.get("sampler", [])
            if r.get("batch") == 64
            and r.get("model", "tiny-moe") == "tiny-moe"
            and r.get("engine", "megatron") == "megatron"
            and "tokens_per_s" in r
        ),
        None,
    )
    tiny = gpu.get("shapes", {}).get("tiny-moe")
    if sampler is None or tiny is None:
        return None
    return _recorded(
        "local_sampler_tokens_per_s_gpu",
        sampler["tokens_per_s"],
        f"{where}: {sampler['path']}, batch 64, tiny-moe",
        tiny["active_matmul_params"],
    )


def _gpu_learner(results: Path) -> dict[str, Figure]:
    out: dict[str, Figure] = {}
    for where, gpu in _gpu_results(results):
        for key, read in (
            ("learner_tokens_per_s_gpu", _learner_figure),
            ("local_sampler_tokens_per_s_gpu", _sampler_figure),
        ):
            if key not in out and (figure := read(where, gpu)) is not None:
                out[key] = figure
    return out


def _cpu_learner(results: Path) -> dict[str, Figure]:
    data = _read(results / "learner_throughput.json")
    if not data:
        return {}
    out = {}
    if "learner_tokens_per_s" in data:
        out["learner_tokens_per_s_cpu"] = _recorded(
            "learner_tokens_per_s_cpu",
            data["learner_tokens_per_s"],
            "learner_throughput.json: train_step, tiny-moe preset, CPU",
        )
    if "sampler_fp32_tokens_per_s" in data:
        out["local_sampler_tokens_per_s_cpu"] = _recorded(
            "local_sampler_tokens_per_s_cpu",
            data["sampler_fp32_tokens_per_s"],
            "learner_throughput.json: local sampler fp32, batch 64, tiny-moe preset, CPU",
        )
    return out


def _ray_scaling(results: Path) -> dict[str, Figure]:
    data = _read(results / "ray_scaling.json")
    rows = (data or {}).get("scaling", [])
    if not rows:
        return {}
    widest = max(rows, key=lambda r: r["workers"])
    ms = widest["driver_cpu_ms_per_episode"]
    return {
        "driver_s_per_episode": _recorded(
            "driver_s_per_episode",
            ms / 1000,
            f"ray_scaling.json: driver CPU {ms:.2f} ms per episode at {widest['workers']} env workers "
            f"(~{1000 / ms:.0f} episodes/s)",
        )
    }
