"""Where the benchmark scripts put what they measured: ``benchmarks/results/<name>.json`` and ``.png``.

Imported by the scripts beside it (``python benchmarks/<script>.py`` puts this
folder on ``sys.path``); it lives outside the installed package.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def write_json(name: str, data: Any, *, indent: int = 2) -> Path:
    """Write ``data`` to ``RESULTS/<name>.json``, creating the folder; the path written."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=indent))
    return path


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend: the benchmarks write files and open no window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, *, dpi: int = 120) -> Path:
    """Lay out ``fig``, write it to ``path`` and close it; the path written."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def save_histograms(
    name: str,
    series: Mapping[str, Any],
    *,
    xlabel: str,
    title: str,
    ylabel: str | None = None,
    colors: Mapping[str, str] | None = None,
    **hist: Any,
) -> Path:
    """One 6 x 3.5 in figure with a histogram per ``series`` entry (legend label -> values), drawn with
    ``hist`` (``Axes.hist`` options) and ``colors`` (by label), written to ``RESULTS/<name>.png``."""
    fig, ax = pyplot().subplots(figsize=(6, 3.5))
    for label, values in series.items():
        color = {"color": colors[label]} if colors else {}
        ax.hist(values, label=label, **color, **hist)
    ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return save_figure(fig, RESULTS / f"{name}.png")
