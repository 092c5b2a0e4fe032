"""The type-check ratchet: mypy on the ``labrl`` package, each file held at or under its baseline count.

mypy cannot see the package as Python imports it: the editable install is an import hook, and the
``package-dir`` mapping of pyproject.toml (``envs/`` is ``labrl.envs``, ...) has no mypy setting. So this
script lays out a tree of symlinks shaped like the installed package (``build/typecheck/labrl/envs`` ->
``envs/``, ...), read from that one mapping, and runs ``mypy -p labrl`` over it ([tool.mypy] in
pyproject.toml points ``mypy_path`` there). Reported paths are mapped back to the repository's.

The ratchet, per file f:  errors(f) <= baseline(f), with baseline(f) = 0 for a file not in the baseline.

    python .ci/typecheck.py            # check (``make typecheck``; CI runs it)
    python .ci/typecheck.py --update   # lower the baseline where counts fell (never raises a count)
    python .ci/typecheck.py --reset    # rewrite the baseline to today's counts (``make typecheck-baseline``)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "typecheck"
BASELINE = ROOT / ".ci" / "mypy-baseline.json"
PACKAGE = "labrl"
# "path:line: error: message  [code]" (mypy's default format, with --show-error-codes)
ERROR_LINE = re.compile(r"^(?P<path>[^:\n]+\.pyi?):\d+(?::\d+)?: error: ")


def package_dirs() -> dict[str, str]:
    """pyproject's [tool.setuptools] package-dir: dotted package -> source folder (relative to ROOT)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def lay_out_tree() -> dict[Path, Path]:
    """Symlink the sources into ``TREE`` in their installed layout; return tree folder -> source folder."""
    mapping = {TREE / Path(*name.split(".")): ROOT / src for name, src in package_dirs().items()}
    root_pkg = TREE / PACKAGE
    if root_pkg not in mapping:
        raise SystemExit(f"pyproject.toml package-dir has no entry for {PACKAGE!r}")
    children = {tree: src for tree, src in mapping.items() if tree != root_pkg}
    for tree in children:
        if tree.parent != root_pkg:  # one level is all pyproject maps today; deeper needs real folders here
            raise SystemExit(
                f"typecheck tree: {tree.relative_to(TREE)} is not a direct subpackage of {PACKAGE}"
            )
    # rebuilt every run: a moved or deleted module must not linger as a stale link
    if root_pkg.exists():
        for entry in root_pkg.iterdir():
            entry.unlink()
    root_pkg.mkdir(parents=True, exist_ok=True)
    for entry in mapping[root_pkg].iterdir():
        if entry.name != "__pycache__" and (root_pkg / entry.name) not in children:
            (root_pkg / entry.name).symlink_to(entry)
    for tree, src in children.items():
        tree.symlink_to(src, target_is_directory=True)
    return mapping


def repo_path(reported: str, mapping: dict[Path, Path]) -> str:
    """A path mypy reported (inside TREE, relative or absolute) as a path relative to ROOT."""
    path = Path(reported)
    if not path.is_absolute():
        path = ROOT / path
    # longest tree folder first: a file of labrl/envs/ belongs to envs/, not to labrl/
    for tree in sorted(mapping, key=lambda p: len(p.parts), reverse=True):
        if path.is_relative_to(tree):
            return (mapping[tree] / path.relative_to(tree)).relative_to(ROOT).as_posix()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else reported


def run_mypy(mapping: dict[Path, Path]) -> tuple[Counter[str], str]:
    """mypy's error count per repository file, and its full report."""
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "-p", PACKAGE, "--show-error-codes", "--no-pretty"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    report = proc.stdout + proc.stderr
    if proc.returncode not in (0, 1):  # 2: mypy itself failed (bad config, crash)
        raise SystemExit(f"mypy failed (exit {proc.returncode}):\n{report}")
    counts: Counter[str] = Counter()
    for line in proc.stdout.splitlines():
        if match := ERROR_LINE.match(line):
            counts[repo_path(match["path"], mapping)] += 1
    return counts, report


def read_baseline() -> dict[str, int]:
    return json.loads(BASELINE.read_text()) if BASELINE.exists() else {}


def write_baseline(counts: dict[str, int]) -> None:
    kept = {path: n for path, n in sorted(counts.items()) if n > 0}
    BASELINE.write_text(json.dumps(kept, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--update", action="store_true", help="lower the baseline where counts fell")
    mode.add_argument("--reset", action="store_true", help="rewrite the baseline to today's counts")
    parser.add_argument("--report", action="store_true", help="print mypy's full report")
    args = parser.parse_args(argv)

    mapping = lay_out_tree()
    counts, report = run_mypy(mapping)
    if args.report:
        print(report)
    baseline = read_baseline()
    total, allowed = sum(counts.values()), sum(baseline.values())
    if args.reset:
        write_baseline(counts)
        print(f"typecheck: baseline reset to {total} errors in {len(counts)} files")
        return 0

    over = {f: (n, baseline.get(f, 0)) for f, n in counts.items() if n > baseline.get(f, 0)}
    under = {f: (counts.get(f, 0), n) for f, n in baseline.items() if counts.get(f, 0) < n}
    if args.update:
        write_baseline({f: min(n, counts.get(f, 0)) for f, n in baseline.items()})
        print(f"typecheck: baseline lowered in {len(under)} files, now {sum(read_baseline().values())}")
    if over:
        print("typecheck: more mypy errors than the baseline allows (.ci/mypy-baseline.json):")
        for f, (n, limit) in sorted(over.items()):
            print(f"  {f}: {n} (baseline {limit})")
        for line in report.splitlines():
            if (match := ERROR_LINE.match(line)) and (path := repo_path(match["path"], mapping)) in over:
                print("  " + path + line[match.end("path") :])
        print("Fix them (or, if files moved, regenerate the baseline: `make typecheck-baseline`).")
        return 1
    print(f"typecheck: {total} mypy errors in {len(counts)} files, baseline allows {allowed}")
    if under and not args.update:
        print(f"typecheck: {len(under)} files under their baseline; lock it in: `make typecheck-update`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
