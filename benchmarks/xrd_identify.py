"""Phase identification of simulated mixtures: ``identify`` vs peak-position matching, same run.

    OMP_NUM_THREADS=1 python benchmarks/xrd_identify.py [--mixtures 200] [--part i/n] [--merge]
        [--full-library] [--library v1|v0] [--foreign]

Mixtures: the tier-3 samples (test split, seeds 1000..) of ``xrd/phase-id-v1`` (default:
answers drawn from the v1 library's experimental entries, v1 physics: anomalous
dispersion at Cu Kα1, graphite monochromator, per-phase Debye–Waller B 0.2-1.0 Å²) or,
with ``--library v0``, of ``xrd/phase-id-v0`` (AFLOW prototypes, ASE elements and
hypothetical substitutions; v0 physics): 2-3 phases sharing elements, weight fractions
from a Dirichlet (each ≥ 10 %), per-phase crystallite size 40-300 nm and lattice strain
±0.2 %, March-Dollase preferred orientation (r 0.8-1.2) on 30 % of phases, zero shift
±0.06°, sample displacement ±0.1 mm, Caglioti W 0.0015-0.003, Cu Kα1/Kα2 doublet
(ratio 0.5), a 3-term Chebyshev background of 100-400 counts, peak counts 5k-20k and
Poisson noise. The lab knows the elements (as from its synthesis or XRF); the
candidates are every phase of ``identify``'s library made of them (v1: the
experimental entries; ``--full-library``: all of them). With v1 the monochromator
angle is given to ``identify`` (the lab knows its diffractometer).

Per mixture:

1. ``identify`` (screening, beam search, v1 fit; ``labrl.verifiers.xrd.identify``):
   top-1 phase set (matched one to one on reduced composition + space group, or on stick
   patterns no experiment tells apart, ``_equivalent``), |weight-fraction
   error| of each true phase when the set is right, wall time.
2. Baseline, peak-position matching (search-match as in the Hanawalt method): picked peaks
   (``peaks.pick_peaks``, up to 40); a phase's figure of merit is the intensity-weighted
   share of its strong lines (≥ 5 % of its strongest, inside the scan) that have an
   observed peak within ±0.1°; phases are added greedily (best FOM × share of the
   still-unexplained observed intensity) while FOM ≥ 0.6 and ≥ 5 % of the observed
   intensity is unexplained, up to 3. Weight fractions: per phase, observed/simulated
   intensity of its matched lines, then the ZMV rule.
3. The label-free reward: ranking of the true set against the hard wrong sets of
   ``envs.xrd.ranking`` for the v0 and the v1 fit, and the v1 reward of the true set
   with its true fractions vs with 20 wt% moved from the major to the minor phase.

``--foreign``: patterns made by other software instead (``labrl.testing.foreign_xrd``:
pymatgen's ``XRDCalculator`` line positions and intensities, pseudo-Voigt profiles with
Caglioti widths, an angle-dependent Lorentzian fraction and axial asymmetry, none of which
labrl's fit models; 15 published structures, 1-3 phases, minor phases at 3-30 % of the
intensity, Poisson noise on sloping backgrounds, some with a low-angle hump). Mixture k is
seed ``FOREIGN_FIRST_SEED + k`` in beam group k mod 3: Cu Kα1 only (a Kα1 monochromator),
the Cu Kα1/Kα2 doublet, or a synchrotron line (0.4959, 0.7293 or 0.8265 Å). As a user with
a bare two-column file would, ``identify`` is told the wavelength (1.5406 for both Cu groups,
so it must decide doublet or single line itself; the synchrotron's own line) and the
elements; candidates are the v1 experimental entries made of them. Scored: top-1 phase set
per beam group, per number of phases and per smallest share, whether the Cu beam chosen is
the one that made the pattern, and the same peak-matching baseline. Weight fractions are not
scored: the generator mixes intensity shares, not weight fractions.

Writes benchmarks/results/xrd_identify[_v0|_foreign][.partIofN].json; ``--merge`` combines the
parts, prints the table and writes benchmarks/results/xrd_identify[_v0|_foreign].json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np
from _results import RESULTS, write_json  # beside this script

FIRST_SEED = 1000
FOREIGN_FIRST_SEED = 5000
MATCH_TOL = 0.1  # degrees 2θ
STRONG_LINE = 0.05
MIN_FOM = 0.6


def _config(version: str):
    from labrl.envs.xrd.tasks import PhaseIdConfig

    if version == "v0":
        return PhaseIdConfig(tier=3)
    return PhaseIdConfig(tier=3, library="v1", answer_pool="experimental", physics="v1")


def _mixture(seed: int, version: str):
    from labrl.envs.xrd.tasks import build_task_prompt
    from labrl.verifiers.xrd.mixture import Sample, measure
    from labrl.verifiers.xrd.readers import MeasuredPattern

    prompt, answer = build_task_prompt(_config(version), "test", seed)
    sample = Sample.model_validate(prompt["sample"])
    m = measure(sample, prompt["noise_seed"])
    inst = sample.instrument
    pattern = MeasuredPattern(
        two_theta=m.two_theta,
        intensity=m.counts,
        sigma=np.sqrt(np.maximum(m.counts, 1.0)),
        wavelength=inst.wavelength_ka1,
        wavelength_ka2=inst.wavelength_ka2,
        ka2_ratio=inst.ka2_ratio,
        source={"format": "simulated", "seed": seed},
    )
    truth = {p["id"]: p["weight_fraction"] for p in answer["phases"]}
    return pattern, truth, prompt["elements"]


def _equivalent(a: str, b: str) -> bool:
    """Same phase: same (reduced composition, space group), or stick patterns no diffraction
    experiment tells apart (the library's few duplicates in another setting, e.g. pyrite in Pa-3
    and in P1; cosine above ``ranking.IDENTICAL_COSINE``, as the ranking study)."""
    from labrl.envs.xrd.ranking import IDENTICAL_COSINE, _fingerprint
    from labrl.verifiers.xrd.library import resolve_phase

    if resolve_phase(a).key == resolve_phase(b).key:
        return True
    return float(_fingerprint(a) @ _fingerprint(b)) > IDENTICAL_COSINE


def _match(predicted, truth) -> dict[str, str] | None:
    """predicted id -> true id when the sets are the same phases one to one, else None."""
    predicted, truth = list(predicted), list(truth)
    if len(predicted) != len(truth):
        return None
    pairs: dict[str, str] = {}
    free = set(truth)
    for p in predicted:
        hit = next((t for t in sorted(free) if _equivalent(p, t)), None)
        if hit is None:
            return None
        pairs[p] = hit
        free.discard(hit)
    return pairs


def peak_match(pattern, candidates, instrument) -> tuple[tuple[str, ...], dict[str, float]]:
    """The baseline (module docstring): greedy search-match on peak positions."""
    from labrl.verifiers.xrd.fit_v1 import sticks_of, zmv_weight_fractions
    from labrl.verifiers.xrd.peaks import pick_peaks

    peaks = pick_peaks(pattern.two_theta, pattern.intensity, max_peaks=40, k_sigma=4.0, min_rel=0.005)
    if not peaks:
        return (), {}
    obs_pos = np.array([p[0] for p in peaks])
    obs_int = np.array([p[1] for p in peaks])
    lines = {}
    for phase in candidates:
        pos, inten = sticks_of(phase, instrument)
        keep = (pos >= instrument.two_theta_min) & (pos <= instrument.two_theta_max)
        pos, inten = pos[keep], inten[keep]
        if len(pos) == 0:
            continue
        strong = inten >= STRONG_LINE * inten.max()
        pos, inten = pos[strong], inten[strong]
        dist = np.abs(pos[:, None] - obs_pos[None, :])  # (lines, peaks)
        nearest = dist.argmin(axis=1)
        hit = dist[np.arange(len(pos)), nearest] <= MATCH_TOL
        fom = float(inten[hit].sum() / inten.sum())
        lines[phase.id] = (phase, pos, inten, nearest, hit, fom)
    explained = np.zeros(len(obs_pos), dtype=bool)
    chosen: list[str] = []
    while len(chosen) < 3:
        remaining = float(obs_int[~explained].sum() / obs_int.sum())
        if remaining < 0.05:
            break
        best, best_score = None, 0.0
        for pid, (_, _, _, nearest, hit, fom) in lines.items():
            if pid in chosen or fom < MIN_FOM:
                continue
            covered = np.zeros(len(obs_pos), dtype=bool)
            covered[nearest[hit]] = True
            gain = float(obs_int[covered & ~explained].sum() / obs_int.sum())
            if gain * fom > best_score:
                best, best_score = pid, gain * fom
        if best is None or best_score < 0.02:
            break
        chosen.append(best)
        _, _, _, nearest, hit, _ = lines[best]
        explained[nearest[hit]] = True
    if not chosen:
        return (), {}
    scales = []
    for pid in chosen:
        _, _, inten, nearest, hit, _ = lines[pid]
        scales.append(float(obs_int[np.unique(nearest[hit])].sum() / max(inten[hit].sum(), 1e-12)))
    phases = [lines[pid][0] for pid in chosen]
    return tuple(chosen), zmv_weight_fractions(phases, np.array(scales), np.ones(len(chosen)))


def run_one(seed: int, full_library: bool, version: str = "v1") -> dict:
    from labrl.envs.xrd.ranking import ranking_case
    from labrl.verifiers.xrd.fit import fit_phases
    from labrl.verifiers.xrd.fit_config import FitConfig
    from labrl.verifiers.xrd.identify import IdentifyOptions, candidate_phases, identify
    from labrl.verifiers.xrd.library import load_library

    lib = load_library(version)
    config = _config(version)
    pattern, truth, elements = _mixture(seed, version)
    out: dict = {"seed": seed, "library": version, "truth": truth}
    # identify's library: v1 experimental entries (all of them with --full-library), or v0
    library = ("v1-all" if full_library else "v1") if version == "v1" else "v0"
    mono = 26.554 if version == "v1" else None  # tasks.MONOCHROMATOR_TWO_THETA

    t0 = time.perf_counter()
    result = identify(
        pattern,
        elements=None if full_library else elements,
        top=3,
        library=library,
        # the tasks draw from the whole experimental library, cryogenic solids (Ne, N2) included
        options=IdentifyOptions(monochromator_two_theta=mono, ambient=False),
    )
    out["identify_s"] = time.perf_counter() - t0
    best = result.best
    out["identify"] = {p.id: p.weight_fraction for p in best.phases}
    pairs = _match(best.ids, truth)
    out["identify_correct"] = pairs is not None
    if pairs is not None:
        out["identify_wf_errors"] = [abs(p.weight_fraction - truth[pairs[p.id]]) for p in best.phases]

    instrument = result.instrument  # the beam and scan identify fitted with
    candidates, _ = candidate_phases((), library, None if full_library else elements, ambient=False)
    t0 = time.perf_counter()
    ids, fractions = peak_match(pattern, candidates, instrument)
    out["baseline_s"] = time.perf_counter() - t0
    out["baseline"] = fractions
    pairs = _match(ids, truth) if ids else None
    out["baseline_correct"] = pairs is not None
    if pairs is not None:
        out["baseline_wf_errors"] = [abs(fractions[i] - truth[pairs[i]]) for i in ids]

    for fit_version in ("v0", "v1"):
        case = ranking_case(seed, "test", FitConfig(version=fit_version), config)
        out[f"ranking_{fit_version}"] = {
            "passed": case.passed,
            "true_reward": case.true_reward,
            "wrong": case.wrong,
        }

    # the v1 reward of the true set: true fractions vs 20 wt% moved from the major to the minor phase
    from labrl.envs.xrd.measure import observe
    from labrl.envs.xrd.tasks import build_task_prompt
    from labrl.verifiers.xrd.profile import Instrument

    prompt, _ = build_task_prompt(config, "test", seed)
    obs = observe(prompt["sample"], prompt["noise_seed"], 10, 0)
    nominal = Instrument.model_validate(prompt["sample"]["instrument"]).model_copy(
        update={"zero_shift": 0.0, "displacement_mm": 0.0}
    )
    phases = [lib.get(pid) for pid in truth]
    v1 = FitConfig(version="v1")
    major, minor = max(truth, key=truth.get), min(truth, key=truth.get)
    wrong = dict(truth)
    wrong[major], wrong[minor] = truth[major] - 0.2, truth[minor] + 0.2
    right_fit = fit_phases(obs["two_theta"], obs["counts"], phases, nominal, v1, claimed_fractions=truth)
    wrong_fit = fit_phases(obs["two_theta"], obs["counts"], phases, nominal, v1, claimed_fractions=wrong)
    out["fraction_reward"] = {"true": right_fit.reward, "off_20wt": wrong_fit.reward}
    return out


def summarize(rows: list[dict]) -> dict:
    def mean(xs):
        return float(np.mean(xs)) if xs else float("nan")

    n = len(rows)
    summary = {"mixtures": n, "library": rows[0].get("library", "v0")}
    for name in ("identify", "baseline"):
        errors = [e for r in rows for e in r.get(f"{name}_wf_errors", [])]
        times = [r[f"{name}_s"] for r in rows]
        summary[name] = {
            "top1_accuracy": sum(r[f"{name}_correct"] for r in rows) / n,
            "mean_abs_wf_error": mean(errors),
            "median_s_per_pattern": float(np.median(times)),
            "mean_s_per_pattern": mean(times),
        }
    for version in ("v0", "v1"):
        key = f"ranking_{version}"
        true = [r[key]["true_reward"] for r in rows]
        summary[key] = {
            "true_set_first": sum(r[key]["passed"] for r in rows) / n,
            "true_reward_min": float(np.min(true)),
            "true_reward_median": float(np.median(true)),
            "true_reward_share_ge_0.9": float(np.mean(np.array(true) >= 0.9)),
        }
    fr = np.array([[r["fraction_reward"]["true"], r["fraction_reward"]["off_20wt"]] for r in rows])
    summary["fraction_reward_v1"] = {
        "true_mean": float(fr[:, 0].mean()),
        "off_20wt_mean": float(fr[:, 1].mean()),
        "share_off_lower_by_0.1": float(np.mean(fr[:, 1] < fr[:, 0] - 0.1)),
    }
    return summary


def table(summary: dict) -> str:
    i, b = summary["identify"], summary["baseline"]
    r0, r1, fr = summary["ranking_v0"], summary["ranking_v1"], summary["fraction_reward_v1"]
    lines = [
        f"{summary['mixtures']} mixtures ({summary.get('library', 'v0')} tier-3 samples, "
        f"test split seeds {FIRST_SEED}..)",
        "| method | top-1 phase set | mean abs wt-fraction error | s / pattern (median) |",
        "|---|---|---|---|",
        f"| identify (screen + v1 fit) | {i['top1_accuracy']:.1%} | {i['mean_abs_wf_error']:.4f} | "
        f"{i['median_s_per_pattern']:.2f} |",
        f"| peak-position matching | {b['top1_accuracy']:.1%} | {b['mean_abs_wf_error']:.4f} | "
        f"{b['median_s_per_pattern']:.3f} |",
        "",
        "| label-free reward | true set ranked first | true reward min | median | share >= 0.9 |",
        "|---|---|---|---|---|",
        f"| v0 fit | {r0['true_set_first']:.1%} | {r0['true_reward_min']:.3f} | {r0['true_reward_median']:.3f} | "
        f"{r0['true_reward_share_ge_0.9']:.1%} |",
        f"| v1 fit | {r1['true_set_first']:.1%} | {r1['true_reward_min']:.3f} | {r1['true_reward_median']:.3f} | "
        f"{r1['true_reward_share_ge_0.9']:.1%} |",
        "",
        f"v1 reward with true fractions {fr['true_mean']:.3f}, with 20 wt% moved major->minor "
        f"{fr['off_20wt_mean']:.3f} (lower by > 0.1 in {fr['share_off_lower_by_0.1']:.1%})",
    ]
    return "\n".join(lines)


def run_foreign(k: int, first_seed: int = FOREIGN_FIRST_SEED) -> dict:
    """Mixture k of the foreign set (module docstring); ``first_seed`` picks another draw of it."""
    from labrl.testing.foreign_xrd import BEAM_GROUPS, LIBRARY_ID, random_mixture
    from labrl.verifiers.xrd.identify import candidate_phases, identify
    from labrl.verifiers.xrd.readers import MeasuredPattern

    mix = random_mixture(first_seed + k, BEAM_GROUPS[k % len(BEAM_GROUPS)])
    truth = {LIBRARY_ID[name]: share for name, share in mix.shares.items()}
    pattern = MeasuredPattern(
        two_theta=mix.two_theta,
        intensity=mix.counts,
        sigma=np.sqrt(np.maximum(mix.counts, 1.0)),
        source={"format": "foreign", "seed": mix.seed},
    )
    out: dict = {
        "seed": mix.seed,
        "beam_group": mix.beam_group,
        "truth": truth,
        "smallest_share": min(mix.shares.values()),
    }
    t0 = time.perf_counter()
    result = identify(pattern, wavelength=mix.wavelength, elements=mix.elements, top=3, library="v1")
    out["identify_s"] = time.perf_counter() - t0
    out["identify"] = {p.id: p.weight_fraction for p in result.best.phases}
    out["identify_correct"] = _match(result.best.ids, truth) is not None
    out["beam"] = result.beam.label if result.beam else None
    if mix.beam_group != "synchrotron":
        out["beam_right"] = bool(result.instrument.ka2_ratio > 0) == (mix.beam_group == "CuKa")
    candidates, _ = candidate_phases((), "v1", mix.elements)
    t0 = time.perf_counter()
    ids, fractions = peak_match(pattern, candidates, result.instrument)
    out["baseline_s"] = time.perf_counter() - t0
    out["baseline"] = fractions
    out["baseline_correct"] = bool(ids) and _match(ids, truth) is not None
    return out


def _share(rows: list[dict], key: str) -> dict:
    return {"n": len(rows), "top1": sum(r[key] for r in rows) / len(rows)} if rows else {"n": 0}


def summarize_foreign(rows: list[dict]) -> dict:
    from labrl.testing.foreign_xrd import BEAM_GROUPS

    summary: dict = {"mixtures": len(rows), "set": "foreign", "first_seed": min(r["seed"] for r in rows)}
    for name in ("identify", "baseline"):
        key = f"{name}_correct"
        summary[name] = {
            "all": _share(rows, key),
            "by_beam": {g: _share([r for r in rows if r["beam_group"] == g], key) for g in BEAM_GROUPS},
            "by_phases": {n: _share([r for r in rows if len(r["truth"]) == n], key) for n in (1, 2, 3)},
            "by_smallest_share": {
                "3-10%": _share([r for r in rows if len(r["truth"]) > 1 and r["smallest_share"] < 0.1], key),
                "10-30%": _share(
                    [r for r in rows if len(r["truth"]) > 1 and r["smallest_share"] >= 0.1], key
                ),
            },
            "median_s_per_pattern": float(np.median([r[f"{name}_s"] for r in rows])),
        }
    cu = [r for r in rows if "beam_right" in r]
    summary["cu_beam_chosen_right"] = sum(r["beam_right"] for r in cu) / len(cu) if cu else None
    summary["misses"] = [
        {"seed": r["seed"], "beam": r["beam_group"], "truth": r["truth"], "identify": r["identify"]}
        for r in rows
        if not r["identify_correct"]
    ]
    return summary


def table_foreign(summary: dict) -> str:
    i, b = summary["identify"], summary["baseline"]

    def cell(x: dict) -> str:
        return f"{x['top1']:.1%} ({x['n']})" if x["n"] else "-"

    groups = [("all", i["all"], b["all"])]
    groups += [(f"beam {g}", i["by_beam"][g], b["by_beam"][g]) for g in i["by_beam"]]
    groups += [(f"{n} phase(s)", i["by_phases"][n], b["by_phases"][n]) for n in i["by_phases"]]
    groups += [
        (f"smallest share {k}", v, b["by_smallest_share"][k]) for k, v in i["by_smallest_share"].items()
    ]
    lines = [
        f"{summary['mixtures']} foreign mixtures (pymatgen XRDCalculator, seeds {summary['first_seed']}..)",
        "| group | identify top-1 (n) | peak matching top-1 (n) |",
        "|---|---|---|",
        *(f"| {name} | {cell(x)} | {cell(y)} |" for name, x, y in groups),
        "",
        f"Cu beam (doublet or Kα1 alone) chosen right: {summary['cu_beam_chosen_right']:.1%}; "
        f"s / pattern (median): identify {i['median_s_per_pattern']:.2f}, baseline {b['median_s_per_pattern']:.3f}",
    ]
    lines += [
        f"miss: seed {m['seed']} ({m['beam']}) true {m['truth']} -> {m['identify']}"
        for m in summary["misses"]
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixtures", type=int, default=200)
    parser.add_argument("--part", default="1/1", help="i/n: run the i-th of n slices of the mixtures")
    parser.add_argument("--merge", action="store_true", help="combine the part files, print and write")
    parser.add_argument(
        "--full-library", action="store_true", help="candidates: all phases, not the elements'"
    )
    parser.add_argument("--library", choices=["v1", "v0"], default="v1", help="task family and library")
    parser.add_argument("--foreign", action="store_true", help="the foreign set (module docstring)")
    parser.add_argument(
        "--first-seed",
        type=int,
        default=FOREIGN_FIRST_SEED,
        help=f"--foreign: seed of mixture 0 (default {FOREIGN_FIRST_SEED}; another value: a held-out draw)",
    )
    args = parser.parse_args()
    if args.foreign and (args.full_library or args.library != "v1"):
        parser.error("--foreign takes neither --full-library nor --library v0")
    if args.first_seed != FOREIGN_FIRST_SEED and not args.foreign:
        parser.error("--first-seed is for --foreign")
    RESULTS.mkdir(exist_ok=True)
    stem = ("xrd_identify_full" if args.full_library else "xrd_identify") + (
        "_v0" if args.library == "v0" else "_foreign" if args.foreign else ""
    )
    if args.foreign and args.first_seed != FOREIGN_FIRST_SEED:
        stem += f"_seed{args.first_seed}"
    summarize_rows, render = (summarize_foreign, table_foreign) if args.foreign else (summarize, table)
    if args.merge:
        parts = sorted(RESULTS.glob(f"{stem}.part*of*.json"))
        if not parts:
            raise SystemExit(f"no {stem}.part*of*.json in {RESULTS}")
        rows = [row for p in parts for row in json.loads(p.read_text())["rows"]]
        rows.sort(key=lambda r: r["seed"])
        summary = summarize_rows(rows)
        out = {
            "summary": summary,
            "rows": rows,
            "parts": [p.name for p in parts],
            "machine": platform.platform(),
        }
        write_json(stem, out, indent=1)
        print(render(summary))
        return 0
    i, n = (int(v) for v in args.part.split("/"))
    indices = [k for k in range(args.mixtures) if k % n == i - 1]
    rows = []
    t0 = time.perf_counter()
    for k in indices:
        rows.append(
            run_foreign(k, args.first_seed)
            if args.foreign
            else run_one(FIRST_SEED + k, args.full_library, args.library)
        )
        r = rows[-1]
        extra = (
            f"beam {r['beam']}"
            if args.foreign
            else f"rank v0 {r['ranking_v0']['passed']} v1 {r['ranking_v1']['passed']}"
        )
        print(
            f"seed {r['seed']}: identify {'ok ' if r['identify_correct'] else 'BAD'} {r['identify_s']:.2f}s  "
            f"baseline {'ok ' if r['baseline_correct'] else 'BAD'}  {extra}",
            flush=True,
        )
    path = RESULTS / (f"{stem}.part{i}of{n}.json" if n > 1 else f"{stem}.json")
    summary = summarize_rows(rows)
    path.write_text(
        json.dumps({"summary": summary, "rows": rows, "wall_s": time.perf_counter() - t0}, indent=1)
    )
    print(render(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
