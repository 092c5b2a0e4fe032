"""Does a config's format-only warm start stay stable? Its first SFT steps' loss, per variant and seed.

The warm start runs as ``labrl train`` runs it (``labrl.harness.backends.parts.warm_start`` on the
learner built from the config), stopped after ``--steps`` of the config's ``sft.steps``, so the lr at
each step is the one the full run uses. Variants change the run config (``--variant
NAME:key=value,key=value``); ``--set key=value`` applies to every variant (a device, a smaller
batch for a CPU probe).

    python benchmarks/sft_stability.py --config configs/gpu/quickstart-h100.yaml --steps 12 \\
        --set learner.device=cpu --set learner.precision=fp32 --set sft.batch_size=16 \\
        --variant asis: --variant warmup25:sft.warmup_steps=25 --seeds 0 --tag h100_cpu
    python benchmarks/sft_stability.py --merge --tag h100_cpu

Each (variant, seed) writes ``benchmarks/results/sft_stability_<tag>/<variant>_seed<N>.json`` after
every step (a killed part keeps its steps; a rerun redoes an unfinished part and skips a finished
one), so parts can run in separate processes at once and be merged. ``--merge`` prints, per variant
over seeds, the first and last loss and the largest *rise*:

    rise = max_k (loss_k - min_{j<k} loss_j)

(nats above the best loss reached before step k: 0 for a loss that never goes up; a step that undoes
what the ones before it learned shows as a rise of the order of the initial loss), and writes
``sft_stability_<tag>.json`` and ``.png`` (loss per step, one line per part).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _results import RESULTS, pyplot, save_figure  # beside this script

from labrl.harness.backends.parts import build_learner, build_tokenizer, make_env_factory, warm_start
from labrl.harness.config import load_run_config

ROOT = Path(__file__).resolve().parents[1]


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``"warmup25:sft.warmup_steps=25,sft.lr=3e-4"`` -> ("warmup25", [two overrides]); ``"asis:"`` -> none."""
    name, sep, rest = text.partition(":")
    if not sep or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise argparse.ArgumentTypeError(
            f"variant {text!r}: want NAME:key=value,... (NAME letters, digits, - or _)"
        )
    overrides = [o.strip() for o in rest.split(",") if o.strip()]
    if any("=" not in o for o in overrides):
        raise argparse.ArgumentTypeError(f"variant {text!r}: every override is key=value")
    return name, overrides


def rise(losses: list[float]) -> float:
    """The largest loss above the best one before it: max_k (loss_k - min_{j<k} loss_j); 0 if none rose."""
    best, worst = math.inf, 0.0
    for loss in losses:
        worst = max(worst, loss - best)
        best = min(best, loss)
    return worst


def result_dir(tag: str) -> Path:
    return RESULTS / f"sft_stability_{tag}"


def run_part(config: str, overrides: list[str], steps: int | None, path: Path, meta: dict[str, Any]) -> dict:
    """Warm-start the config's learner for ``steps`` steps (all: None), writing ``path`` after each."""
    cfg = load_run_config(ROOT / config if not Path(config).is_absolute() else config, overrides)
    if not cfg.sft.enabled:
        raise SystemExit(f"{config}: sft.enabled is false, there is no warm start to measure")
    torch.set_num_threads(cfg.pipeline.torch_threads)
    torch.manual_seed(cfg.seed)  # as the run does before it builds the learner
    tokenizer = build_tokenizer(cfg)
    learner = build_learner(cfg, tokenizer)
    want = cfg.sft.steps if steps is None else min(steps, cfg.sft.steps)
    result: dict[str, Any] = {
        **meta,
        "overrides": overrides,
        "sft": cfg.sft.model_dump(mode="json"),
        "device": str(next(learner.model.parameters()).device),
        "torch": torch.__version__,
        "steps_wanted": want,
        "complete": False,
        "records": [],
    }

    def on_step(record: dict[str, Any]) -> None:
        result["records"].append(record)
        result["complete"] = len(result["records"]) >= want
        path.write_text(json.dumps(result, indent=1))
        print(
            f"  {meta['variant']} seed {meta['seed']}: step {record['sft_step']:4d}  lr {record['lr']:.2e}  "
            f"loss {record['loss']:.4f}  ({record['time_s']:.0f} s)",
            flush=True,
        )

    path.write_text(json.dumps(result, indent=1))
    asyncio.run(
        warm_start(
            learner,
            cfg,
            tokenizer,
            make_env_factory(cfg),
            on_sft=on_step,
            should_stop=lambda: len(result["records"]) >= want,
        )
    )
    return result


def summarise(part: dict[str, Any]) -> dict[str, Any]:
    losses = [r["loss"] for r in part["records"]]
    peak = max(range(len(losses)), key=losses.__getitem__) if losses else None
    return {
        "variant": part["variant"],
        "seed": part["seed"],
        "steps": len(losses),
        "complete": part["complete"],
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "max_loss": losses[peak] if losses else None,
        "max_at_step": peak + 1 if peak is not None else None,
        "rise": rise(losses),
        "s_per_step": part["records"][-1]["time_s"] / len(losses) if losses else None,
    }


def merge(tag: str) -> dict[str, Any]:
    folder = result_dir(tag)
    parts = [json.loads(p.read_text()) for p in sorted(folder.glob("*_seed*.json"))]
    if not parts:
        raise SystemExit(f"no parts in {folder}: run some variants first")
    rows = [summarise(p) for p in parts]
    by_variant: dict[str, list[dict]] = {}
    for r in rows:
        by_variant.setdefault(r["variant"], []).append(r)
    print(
        f"{'variant':14} {'seeds':>5} {'steps':>6} {'first':>7} {'last (median, range)':>24} "
        f"{'rise (median, range)':>24} {'s/step':>7}"
    )
    variants = {}
    for name, rs in by_variant.items():
        last = [r["last_loss"] for r in rs if r["last_loss"] is not None]
        rises = [r["rise"] for r in rs]
        variants[name] = {
            "seeds": [r["seed"] for r in rs],
            "steps": [r["steps"] for r in rs],
            "last_loss": {"median": statistics.median(last), "min": min(last), "max": max(last)}
            if last
            else None,
            "rise": {"median": statistics.median(rises), "min": min(rises), "max": max(rises)},
            "overrides": next(p["variant_overrides"] for p in parts if p["variant"] == name),
        }
        v = variants[name]
        first = statistics.median(r["first_loss"] for r in rs if r["first_loss"] is not None)
        ll = v["last_loss"]
        print(
            f"{name:14} {len(rs):5d} {min(v['steps']):6d} {first:7.3f} "
            f"{ll['median']:9.3f} ({ll['min']:.3f}-{ll['max']:.3f}) "
            f"{v['rise']['median']:11.3f} ({v['rise']['min']:.3f}-{v['rise']['max']:.3f}) "
            f"{statistics.median(r['s_per_step'] for r in rs):7.1f}"
        )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for p in parts:
        xs = [r["sft_step"] for r in p["records"]]
        ax.plot(xs, [r["loss"] for r in p["records"]], marker=".", label=f"{p['variant']} seed {p['seed']}")
    ax.set_xlabel("warm-start step")
    ax.set_ylabel("target-token NLL (nats)")
    ax.set_title(f"format-only warm start: {parts[0]['config']}", fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, RESULTS / f"sft_stability_{tag}.png")
    common = sorted(
        {
            o
            for p in parts
            for o in p["overrides"]
            if o not in p["variant_overrides"] and not o.startswith("seed=")
        }
    )
    out = {
        "tag": tag,
        "config": parts[0]["config"],
        "common_overrides": common,
        "variants": variants,
        "parts": rows,
    }
    (RESULTS / f"sft_stability_{tag}.json").write_text(json.dumps(out, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/gpu/quickstart-h100.yaml")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a run-config override for every variant (repeatable)",
    )
    p.add_argument(
        "--variant",
        dest="variants",
        action="append",
        type=parse_variant,
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="a variant (repeatable; default one, 'asis', the config)",
    )
    p.add_argument("--seeds", default="0", help="comma-separated run seeds (model init and prompts)")
    p.add_argument(
        "--steps", type=int, default=None, help="warm-start steps to run (default all of sft.steps)"
    )
    p.add_argument("--tag", default="default", help="names the result folder: sft_stability_<tag>/")
    p.add_argument("--merge", action="store_true", help="print the table and write the JSON and plot")
    args = p.parse_args(argv)
    if args.merge:
        merge(args.tag)
        return 0
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    names = [n for n, _ in args.variants]
    if len(set(names)) != len(names):
        p.error(f"variant names repeat: {names}")
    folder = result_dir(args.tag)
    folder.mkdir(parents=True, exist_ok=True)
    for name, variant in args.variants or [("asis", [])]:
        for seed in seeds:
            path = folder / f"{name}_seed{seed}.json"
            if path.is_file() and json.loads(path.read_text()).get("complete"):
                print(f"{path.name}: done, skipped")
                continue
            print(f"{name} seed {seed}: {args.config} {' '.join(args.overrides + variant)}", flush=True)
            t0 = time.perf_counter()
            meta = {"variant": name, "seed": seed, "config": args.config, "variant_overrides": variant}
            part = run_part(args.config, [*args.overrides, *variant, f"seed={seed}"], args.steps, path, meta)
            print(
                f"{name} seed {seed}: {len(part['records'])} steps in {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
