"""``labrl xrd identify PATTERN``: phase identification of a measured powder pattern."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(subparsers: Any) -> None:
    group = subparsers.add_parser(
        "xrd", help="X-ray powder diffraction: identify phases in a measured pattern"
    )
    sub = group.add_subparsers(dest="xrd_command", metavar="COMMAND", required=True)
    p = sub.add_parser(
        "identify",
        help="rank phase sets (weight fractions, lattice, size, Rwp) for a pattern file",
        description="Reads .xy/.xye/.csv/.xrdml, screens the candidates (your CIFs and/or the library), "
        "fits the best phase sets and ranks them by the label-free reward (docs/xrd-identify.md).",
    )
    p.add_argument("pattern", help="pattern file: .xy, .xye, .csv, .dat, .txt or .xrdml")
    p.add_argument(
        "--radiation",
        default=None,
        metavar="NAME",
        help="the tube's lines: CuKa (Kα1+Kα2, ratio 0.5), CuKa1 (Kα1 monochromator); likewise "
        "Cr, Fe, Co, Mo, Ag. A file's own usedWavelength keeps priority",
    )
    p.add_argument(
        "--wavelength",
        type=float,
        default=None,
        help="Å, used when the file states none: one monochromatic line (synchrotron); an anode's Kα1 "
        "(e.g. 1.5406) without --radiation is fitted as the Kα1/Kα2 doublet and as Kα1 alone, and the "
        "lower Rwp is kept",
    )
    p.add_argument(
        "--cif", action="append", default=[], metavar="FILE", help="candidate structure (repeatable)"
    )
    p.add_argument(
        "--library",
        default="v1",
        choices=["v1", "v1-all", "v0", "none", "default"],
        help="v1 (default; the v1 library's experimental entries), v1-all (with hypothetical ones), "
        "v0 (frozen), none (only --cif); 'default' = v1",
    )
    p.add_argument(
        "--monochromator",
        type=float,
        default=None,
        metavar="DEG",
        help="Bragg angle 2θ_m of a monochromator crystal (graphite 002 with Cu Kα: 26.554)",
    )
    p.add_argument("--elements", default=None, help="only library phases made of these, e.g. Ti,O,Na,Cl")
    p.add_argument(
        "--cryogenic",
        action="store_true",
        help="also try library phases that are solid only cold (solid O2, N2, NH3, noble gases, Hg)",
    )
    p.add_argument("--top", type=int, default=5, help="how many ranked phase sets to report")
    p.add_argument("--max-phases", type=int, default=3, help="largest phase set tried")
    p.add_argument("--plot", default=None, metavar="PNG", help="write observed vs fitted (best set) here")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_identify)


def cmd_identify(args: argparse.Namespace) -> int:
    from labrl.errors import ConfigError
    from labrl.verifiers.xrd.identify import IdentifyOptions, identify, plot_fit

    if args.top < 1:
        raise ConfigError("--top must be at least 1")
    elements = [e.strip() for e in args.elements.split(",") if e.strip()] if args.elements else None
    result = identify(
        args.pattern,
        wavelength=args.wavelength,
        radiation=args.radiation,
        cifs=args.cif,
        library=args.library,
        elements=elements,
        top=args.top,
        options=IdentifyOptions(
            max_phases=args.max_phases, monochromator_two_theta=args.monochromator, ambient=not args.cryogenic
        ),
    )
    plot = str(plot_fit(result, args.plot)) if args.plot else None
    if args.json:
        print(json.dumps({**result.to_dict(), "plot": plot}, indent=1))
        return 0
    inst = result.instrument
    print(
        f"{args.pattern}: {len(result.pattern.two_theta)} points, 2θ {inst.two_theta_min:g}-{inst.two_theta_max:g}°, "
        f"λ Kα1 {inst.wavelength_ka1:.5f} Å" + (f", Kα2/Kα1 {inst.ka2_ratio:g}" if inst.ka2_ratio else "")
    )
    if result.beam is not None:
        tried = "; ".join(f"{label}: Rwp {rwp:.4f}" for label, rwp in result.beam_rwp.items())
        print(f"beam: {result.beam.label} (from the {result.beam_source}" + (f"; {tried})" if tried else ")"))
    for rank, found in enumerate(result.ranked, start=1):
        print(f"#{rank}  reward {found.reward:.3f}  Rwp {found.rwp:.4f}  Rexp {found.rexp:.4f}")
        for p in found.phases:
            abc = " ".join(f"{x:.4f}" for x in p.abc)
            flag = "  (not significant)" if p.id in found.superfluous else ""
            print(
                f"    {p.weight_fraction:6.1%}  {p.id:<28} {p.space_group:<16} a,b,c {abc} Å  "
                f"size {p.crystallite_nm:g} nm  strain {p.microstrain:g}{flag}"
            )
    if plot:
        print(f"wrote {plot}")
    return 0
