"""XRD simulation benchmark: labrl vs pymatgen XRDCalculator, in the same run.

    OMP_NUM_THREADS=1 python benchmarks/xrd_sim.py [--mixtures 1000] [--scoring 30] [--ranking 100]
        [--parts sticks,mixtures,scoring,ranking]

Measures, single-threaded:
1. stick patterns for every library phase: ms per structure for labrl and for
   pymatgen, the speed ratio and the max deviation (2θ in degrees; intensity
   relative to the strongest peak);
2. noisy mixture profiles (1–3 phases, Hill–Howard scaling, Kα doublet,
   Poisson): ms per profile;
3. label-free scoring (full-profile fit) of 3-phase answers: ms per answer, for
   ``fit_phase_ids`` and for the straightforward reference implementation
   (``_fit_reference``) interleaved on the same answers, wall and CPU time, and
   their largest disagreement;
4. the ranking study (label-free reward of the true set vs hard wrong sets);
5. ``large``: supercells of a 72-site cell (72 to 576 sites) with Cu Kα and
   Mo Kα: time and peak traced memory (tracemalloc) of labrl and pymatgen,
   labrl's peak without chunking where that fits, and for the largest case a
   cProfile split of labrl's time by step.
Writes benchmarks/results/xrd_sim.json and a PNG of the per-structure times.

    OMP_NUM_THREADS=1 python benchmarks/xrd_sim.py --parts large   # ~4 min
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
from _results import RESULTS, pyplot, save_figure, write_json  # beside this script


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


def bench_scoring(n: int, repeats: int = 3) -> dict:
    """Label-free scoring of true 3-phase answers: ``fit_phase_ids`` against the straightforward
    reference implementation (``_fit_reference``), interleaved on the same answers in the same run."""
    from _fit_reference import fit_phase_ids_reference  # beside this script

    from labrl.envs.xrd.measure import observe
    from labrl.envs.xrd.tasks import PhaseIdConfig, build_task_prompt
    from labrl.verifiers.xrd.fit import fit_phase_ids
    from labrl.verifiers.xrd.profile import Instrument

    wall = {"fast": [], "reference": []}
    cpu = {"fast": [], "reference": []}
    max_dev = {"reward": 0.0, "rwp_rel": 0.0, "weight_fraction": 0.0}
    seed, answers = 0, 0
    while answers < n:
        prompt, answer = build_task_prompt(PhaseIdConfig(tier=3), "test", seed)
        seed += 1
        if len(answer["phases"]) != 3:
            continue
        answers += 1
        obs = observe(prompt["sample"], prompt["noise_seed"], 6, 0)
        inst = Instrument.model_validate(prompt["sample"]["instrument"]).model_copy(
            update={"zero_shift": 0.0, "displacement_mm": 0.0}
        )
        ids = tuple(p["id"] for p in answer["phases"])
        args = (obs["two_theta"], obs["counts"], ids, inst)
        # first calls warm the stick cache, as a running env has; they also give the deviations
        fast, ref = fit_phase_ids(*args), fit_phase_ids_reference(*args)
        max_dev["reward"] = max(max_dev["reward"], abs(fast.reward - ref.reward))
        max_dev["rwp_rel"] = max(max_dev["rwp_rel"], abs(fast.rwp - ref.rwp) / ref.rwp)
        max_dev["weight_fraction"] = max(
            max_dev["weight_fraction"],
            max(abs(fast.weight_fractions[k] - ref.weight_fractions[k]) for k in ids),
        )
        for _ in range(repeats):
            for name, fn in (("fast", fit_phase_ids), ("reference", fit_phase_ids_reference)):
                w0, c0 = time.perf_counter(), time.process_time()
                fn(*args)
                wall[name].append(time.perf_counter() - w0)
                cpu[name].append(time.process_time() - c0)

    def stats(times: list[float]) -> dict:
        return {"median": 1e3 * float(np.median(times)), "p90": 1e3 * float(np.percentile(times, 90))}

    return {
        "n_answers": n,
        "repeats": repeats,
        "ms_per_3phase_answer_median": stats(wall["fast"])["median"],
        "ms_per_3phase_answer_p90": stats(wall["fast"])["p90"],
        "wall_ms": {k: stats(v) for k, v in wall.items()},
        "cpu_ms": {k: stats(v) for k, v in cpu.items()},
        "speedup_median_wall": float(np.median(wall["reference"]) / np.median(wall["fast"])),
        "speedup_median_cpu": float(np.median(cpu["reference"]) / np.median(cpu["fast"])),
        "max_deviation_vs_reference": max_dev,
        "load_average_1_5_15": list(os.getloadavg()),
    }


_LARGE_BASE = "SiO2_9_mC144"  # v1 library: monoclinic tridymite-like SiO2, 72 sites in the stored cell
_LARGE_SUPERCELLS = ((1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 2, 2))
_UNCHUNKED_LIMIT_BYTES = 1.5e9  # skip the all-at-once run where its temporaries would exceed this


def _timed_peak(fn) -> tuple[float, float, object]:
    """(seconds without tracing, peak traced MB of a second, traced call, result)."""
    import tracemalloc

    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1] / 1e6
    tracemalloc.stop()
    return seconds, peak, result


def bench_large() -> dict:
    import cProfile
    import pstats
    import warnings

    from pymatgen.analysis.diffraction.xrd import XRDCalculator

    import labrl.verifiers.xrd.simulate as simulate
    from labrl.verifiers.xrd.library import Phase, load_library

    warnings.filterwarnings("ignore")
    base = load_library("v1").get(_LARGE_BASE)
    simulate.stick_pattern(base)  # warm the one-time loads (scattering table) out of the first row
    XRDCalculator("CuKa").get_pattern(base.to_pymatgen())
    rows = []
    for radiation, wavelength in (("CuKa", 1.54184), ("MoKa", 0.71073)):
        for multiples in _LARGE_SUPERCELLS:
            structure = base.to_pymatgen()
            structure.make_supercell(list(multiples))
            occupancy = np.array(
                [[site.species.get_el_amt_dict().get(el, 0.0) for el in base.elements] for site in structure]
            )
            phase = Phase(
                id=f"{base.id}x{''.join(map(str, multiples))}",
                formula=base.formula,
                spacegroup_symbol="P1",
                spacegroup_number=1,
                crystal_system="triclinic",
                elements=base.elements,
                lattice=structure.lattice.matrix,
                frac_coords=structure.frac_coords,
                occupancy=occupancy,
                cell_mass=base.cell_mass * len(structure) / len(base.frac_coords),
                volume=structure.volume,
                source="benchmark",
            )
            t_lab, mem_lab, mine = _timed_peak(
                lambda p=phase, w=wavelength: simulate.stick_pattern(p, wavelength=w)
            )
            n_refl = len(simulate.reflections(phase, wavelength=wavelength).hkl)
            calc = XRDCalculator(radiation)
            t_pmg, mem_pmg, ref = _timed_peak(lambda s=structure, c=calc: c.get_pattern(s))
            unchunked_bytes = 16.0 * 4 * n_refl * len(structure)  # ~4 complex (M, N) temporaries
            mem_unchunked = None
            if unchunked_bytes < _UNCHUNKED_LIMIT_BYTES:
                saved = simulate.CHUNK_ELEMENTS
                simulate.CHUNK_ELEMENTS = 1 << 62
                try:
                    _, mem_unchunked, _ = _timed_peak(
                        lambda p=phase, w=wavelength: simulate.stick_pattern(p, wavelength=w)
                    )
                finally:
                    simulate.CHUNK_ELEMENTS = saved
            assert len(ref.x) == len(mine.two_theta), phase.id
            rows.append(
                {
                    "radiation": radiation,
                    "sites": len(structure),
                    "reflections": n_refl,
                    "labrl_s": t_lab,
                    "pymatgen_s": t_pmg,
                    "speed_ratio": t_pmg / t_lab,
                    "labrl_peak_mb": mem_lab,
                    "labrl_unchunked_peak_mb": mem_unchunked,
                    "unchunked_estimate_mb": unchunked_bytes / 1e6,
                    "pymatgen_peak_mb": mem_pmg,
                    "max_dev_two_theta_deg": float(np.abs(ref.x - mine.two_theta).max()),
                    "max_dev_rel_intensity": float(np.abs(ref.y - mine.scaled).max() / 100.0),
                }
            )
            print(f"  large: {rows[-1]}", flush=True)
    # where the time goes, largest Mo Kα case
    profiler = cProfile.Profile()
    profiler.enable()
    simulate.stick_pattern(phase, wavelength=0.71073)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    total = sum(v[2] for v in stats.values())  # self (tottime) of everything
    steps = {}
    for (filename, _line, name), (_cc, _nc, tottime, cumtime, _callers) in stats.items():
        if filename.endswith("simulate.py"):
            steps[name] = {"self_s": tottime, "cumulative_s": cumtime}
    return {"base": _LARGE_BASE, "rows": rows, "profile_576_mo": {"total_s": total, "steps": steps}}


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


#: what ``--parts`` may name, in the order they are measured
PARTS = ("sticks", "mixtures", "scoring", "ranking", "large")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mixtures", type=int, default=1000)
    parser.add_argument("--scoring", type=int, default=30)
    parser.add_argument("--ranking", type=int, default=100)
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="comma-separated subset to measure; the others keep their values in the JSON",
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    unknown = parts - set(PARTS)
    if unknown:
        parser.error(f"unknown --parts {sorted(unknown)}")
    path = RESULTS / "xrd_sim.json"
    out = json.loads(path.read_text()) if path.exists() and parts != set(PARTS) else {}
    out["machine"] = {
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "note": "shared, contended CPU",
    }
    measure = {
        "sticks": bench_sticks,
        "mixtures": lambda: bench_mixtures(args.mixtures),
        "scoring": lambda: bench_scoring(args.scoring),
        "ranking": lambda: bench_ranking(args.ranking),
        "large": bench_large,
    }
    for part in PARTS:
        if part in parts:
            out[part] = measure[part]()
    missing = set(PARTS) - set(out)
    if missing:
        parser.error(f"no earlier results for {sorted(missing)}: measure them too")
    s = out["sticks"]
    sc = out["scoring"]
    rows = [
        ("stick patterns, library", f"{s['n_structures']} structures"),
        ("labrl ms / structure", f"{s['labrl_ms_per_structure']:.2f}"),
        ("pymatgen ms / structure", f"{s['pymatgen_ms_per_structure']:.2f}"),
        ("speed ratio (pymatgen / labrl)", f"{s['speed_ratio']:.1f}x"),
        ("max |Δ2θ| (deg)", f"{s['max_dev_two_theta_deg']:.1e}"),
        ("max |ΔI| / I_max", f"{s['max_dev_rel_intensity']:.1e}"),
        ("mixture profiles", f"{out['mixtures']['n_profiles']} at {out['mixtures']['ms_per_profile']:.2f} ms each"),
        ("label-free score, 3 phases (median / p90 ms)",
         f"{sc['ms_per_3phase_answer_median']:.1f} / {sc['ms_per_3phase_answer_p90']:.1f}"),
        ("  reference implementation, same run (median / p90 ms)",
         f"{sc['wall_ms']['reference']['median']:.1f} / {sc['wall_ms']['reference']['p90']:.1f}"),
        ("  speed-up, median wall / CPU", f"{sc['speedup_median_wall']:.2f}x / {sc['speedup_median_cpu']:.2f}x"),
        ("  max |Δreward| vs reference", f"{sc['max_deviation_vs_reference']['reward']:.1e}"),
        ("true set ranked first (label-free)",
         f"{out['ranking']['fraction_true_set_ranked_first']:.3f} of {out['ranking']['n_tasks']} tasks"),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print("\nlarge cells (supercells of v1 " + out["large"]["base"] + ")")
    print("radiation sites reflections labrl_s pymatgen_s ratio labrl_MB unchunked_MB pymatgen_MB max_dI")
    for r in out["large"]["rows"]:
        unchunked = "-" if r["labrl_unchunked_peak_mb"] is None else f"{r['labrl_unchunked_peak_mb']:.0f}"
        print(
            f"{r['radiation']:<9} {r['sites']:>5} {r['reflections']:>11} {r['labrl_s']:>7.2f} "
            f"{r['pymatgen_s']:>10.2f} {r['speed_ratio']:>5.1f} {r['labrl_peak_mb']:>8.1f} "
            f"{unchunked:>12} {r['pymatgen_peak_mb']:>11.1f} {r['max_dev_rel_intensity']:.1e}"
        )
    prof = out["large"]["profile_576_mo"]
    print(f"profile, 576 sites Mo Ka: {prof['total_s']:.2f} s")
    for name, v in sorted(prof["steps"].items(), key=lambda kv: -kv[1]["self_s"]):
        print(f"  {name:<24} self {v['self_s']:.3f} s  cumulative {v['cumulative_s']:.3f} s")
    per = s.pop("_per_structure", None)
    write_json("xrd_sim", out)
    if per is None:  # sticks not measured in this run: keep the earlier plot
        return
    plt = pyplot()

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
    save_figure(fig, RESULTS / "xrd_sim.png")


if __name__ == "__main__":
    main()
