"""XRD simulation benchmark: labrl vs pymatgen XRDCalculator, in the same run.

    OMP_NUM_THREADS=1 python benchmarks/xrd_sim.py [--mixtures 1000] [--ranking 40]

Measures, single-threaded:
1. stick patterns for every library phase: ms per structure for labrl and for
   pymatgen, the speed ratio and the max deviation (2θ in degrees; intensity
   relative to the strongest peak);
2. noisy mixture profiles (1–3 phases, Hill–Howard scaling, Kα doublet,
   Poisson): ms per profile;
3. label-free scoring (full-profile fit) of 3-phase answers: ms per answer;
4. the ranking study (label-free reward of the true set vs hard wrong sets).
Writes benchmarks/results/xrd_sim.json and a PNG of the per-structure times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np

RESULTS = Path(__file__).with_name("results")


def bench_sticks() -> dict:
    from pymatgen.analysis.diffraction.xrd import XRDCalculator

    from labrl.verifiers.xrd.library import load_library
    from labrl.verifiers.xrd.simulate import stick_pattern

    library = load_library()
    calc = XRDCalculator("CuKa")
    structures = [p.to_pymatgen() for p in library]
    stick_pattern(library.phases[0])  # warm caches (scattering table)
    t_lab, t_pmg, dpos, dint, sizes = [], [], 0.0, 0.0, []
    for phase, structure in zip(library, structures, strict=True):
        t0 = time.perf_counter()
        ref = calc.get_pattern(structure)
        t1 = time.perf_counter()
        mine = stick_pattern(phase)
        t2 = time.perf_counter()
        t_pmg.append(t1 - t0)
        t_lab.append(t2 - t1)
        sizes.append(len(phase.frac_coords))
        assert len(ref.x) == len(mine.two_theta), phase.id
        dpos = max(dpos, float(np.abs(ref.x - mine.two_theta).max()))
        dint = max(dint, float(np.abs(ref.y - mine.scaled).max() / 100.0))
    return {
        "n_structures": len(library),
        "labrl_ms_per_structure": 1e3 * float(np.mean(t_lab)),
        "pymatgen_ms_per_structure": 1e3 * float(np.mean(t_pmg)),
        "speed_ratio": float(np.sum(t_pmg) / np.sum(t_lab)),
        "max_dev_two_theta_deg": dpos,
        "max_dev_rel_intensity": dint,
        "_per_structure": {
            "sites": sizes,
            "labrl_ms": [1e3 * t for t in t_lab],
            "pymatgen_ms": [1e3 * t for t in t_pmg],
        },
    }


def bench_mixtures(n: int) -> dict:
    from labrl.envs.xrd.tasks import PhaseIdConfig, build_task_prompt
    from labrl.verifiers.xrd.mixture import Sample, measure

    samples = []
    for seed in range(n):
        tier = 1 + seed % 3
        prompt, _ = build_task_prompt(PhaseIdConfig(tier=tier), "train", seed)
        samples.append((Sample.model_validate(prompt["sample"]), prompt["noise_seed"]))
    t0 = time.perf_counter()
    for sample, noise in samples:
        measure(sample, noise)
    dt = time.perf_counter() - t0
    return {"n_profiles": n, "ms_per_profile": 1e3 * dt / n}


def bench_scoring(n: int) -> dict:
    from labrl.envs.xrd.measure import observe
    from labrl.envs.xrd.tasks import PhaseIdConfig, build_task_prompt
    from labrl.verifiers.xrd.fit import fit_phase_ids
    from labrl.verifiers.xrd.profile import Instrument

    times, seed = [], 0
    while len(times) < n:
        prompt, answer = build_task_prompt(PhaseIdConfig(tier=3), "test", seed)
        seed += 1
        if len(answer["phases"]) != 3:
            continue
        obs = observe(prompt["sample"], prompt["noise_seed"], 6, 0)
        inst = Instrument.model_validate(prompt["sample"]["instrument"]).model_copy(
            update={"zero_shift": 0.0, "displacement_mm": 0.0}
        )
        ids = tuple(p["id"] for p in answer["phases"])
        fit_phase_ids(
            obs["two_theta"], obs["counts"], ids, inst
        )  # warm the stick cache, as a running env has
        t0 = time.perf_counter()
        fit_phase_ids(obs["two_theta"], obs["counts"], ids, inst)
        times.append(time.perf_counter() - t0)
    return {
        "n_answers": n,
        "ms_per_3phase_answer_median": 1e3 * float(np.median(times)),
        "ms_per_3phase_answer_p90": 1e3 * float(np.percentile(times, 90)),
    }


def bench_ranking(n: int) -> dict:
    from labrl.envs.xrd.ranking import ranking_study

    fraction, cases = ranking_study(range(n))
    return {
        "n_tasks": n,
        "fraction_true_set_ranked_first": fraction,
        "failures": [
            {"seed": c.seed, "true": c.true_ids, "true_reward": c.true_reward, "wrong": c.wrong}
            for c in cases
            if not c.passed
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mixtures", type=int, default=1000)
    parser.add_argument("--scoring", type=int, default=30)
    parser.add_argument("--ranking", type=int, default=100)
    args = parser.parse_args()
    out = {
        "machine": {
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "note": "shared, contended CPU",
        },
        "sticks": bench_sticks(),
        "mixtures": bench_mixtures(args.mixtures),
        "scoring": bench_scoring(args.scoring),
        "ranking": bench_ranking(args.ranking),
    }
    s = out["sticks"]
    rows = [
        ("stick patterns, library", f"{s['n_structures']} structures"),
        ("labrl ms / structure", f"{s['labrl_ms_per_structure']:.2f}"),
        ("pymatgen ms / structure", f"{s['pymatgen_ms_per_structure']:.2f}"),
        ("speed ratio (pymatgen / labrl)", f"{s['speed_ratio']:.1f}x"),
        ("max |Δ2θ| (deg)", f"{s['max_dev_two_theta_deg']:.1e}"),
        ("max |ΔI| / I_max", f"{s['max_dev_rel_intensity']:.1e}"),
        ("mixture profiles", f"{out['mixtures']['n_profiles']} at {out['mixtures']['ms_per_profile']:.2f} ms each"),
        ("label-free score, 3 phases (median / p90 ms)",
         f"{out['scoring']['ms_per_3phase_answer_median']:.1f} / {out['scoring']['ms_per_3phase_answer_p90']:.1f}"),
        ("true set ranked first (label-free)",
         f"{out['ranking']['fraction_true_set_ranked_first']:.3f} of {out['ranking']['n_tasks']} tasks"),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    per = s.pop("_per_structure")
    (RESULTS / "xrd_sim.json").write_text(json.dumps(out, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(per["sites"], per["pymatgen_ms"], s=6, label="pymatgen XRDCalculator")
    ax.scatter(per["sites"], per["labrl_ms"], s=6, label="labrl")
    ax.set(
        xlabel="sites in cell",
        ylabel="ms per stick pattern",
        yscale="log",
        title="XRD stick patterns (1 thread)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "xrd_sim.png", dpi=120)


if __name__ == "__main__":
    main()
