"""Every relative link (and its #anchor) in README.md, docs/*.md and benchmarks/README.md resolves
inside the repository, and so does every path named in the prose, comments and docstrings of the
Markdown, Python, YAML and TOML files (``harness/pipeline/runner.py``, ``docs/ray.md#anchor``,
``ARCHITECTURE.md``)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (links there are not links)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (match := re.match(r"^#{1,6}\s+(.*)$", line)):
            base = slug(match.group(1))
            name, n = base, 0
            while name in found:  # GitHub numbers repeated headings: x, x-1, x-2
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if resolved != root.resolve() and root.resolve() not in resolved.parents:
            problems.append(f"{path.relative_to(root)}: {target} (outside the repository)")
        elif not resolved.exists():
            problems.append(f"{path.relative_to(root)}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{path.relative_to(root)}: {target} (no such heading)")
    return problems


#: a path-looking reference: folders and a file of a source type (``envs/episode.py``,
#: ``docs/ray.md#anchor``), or a bare upper-case Markdown name (``README.md``)
PATH_REF = re.compile(
    r"(?<![\w./@:$~{-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|ya?ml|toml|sh)|[A-Z][A-Z_]+\.md)(?:#([\w-]+))?(?![\w/])"
)
#: where the installed package's folders sit in the repository (pyproject's package-dir)
INSTALLED_AS = {
    name.replace(".", "/") + "/": folder + "/"
    for name, folder in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].items()
    if name != folder
}
#: other projects' source files the code cites (not in this repository)
ELSEWHERE = ("megatron/", "sglang/srt/")
SKIPPED_DIRS = {".git", ".venv", ".venv-interop", "build", "dist", "runs", "__pycache__"}
SOURCE_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml"}


def _walk(root: Path) -> list[Path]:
    return [
        p
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and not any(part in SKIPPED_DIRS or part.endswith(".egg-info") for part in p.relative_to(root).parts)
    ]


def stale_paths(
    root: Path = ROOT, skip: frozenset[Path] = frozenset(), installed_as: dict[str, str] = INSTALLED_AS
) -> list[str]:
    """``file:line: reference`` for every path-looking reference no file of the repository ends with.

    A reference resolves when some file's path ends with it (``pipeline/runner.py`` names
    ``harness/pipeline/runner.py``), after mapping installed paths (``labrl/harness/x.py``)
    to the repository's folders; a ``#anchor`` on a Markdown file must be one of its headings.
    Paths of files the reader creates are named ``my_*`` (``configs/my_run.yaml``) or sit in the ``mylab``
    package of docs/envs.md's recipe, and are not checked.
    """
    files = _walk(root)
    endings: dict[str, Path] = {}
    for p in files:
        parts = p.relative_to(root).parts
        for i in range(len(parts)):
            endings.setdefault("/".join(parts[i:]), p)
    problems = []
    for path in files:
        if path.suffix not in SOURCE_SUFFIXES or path in skip:
            continue
        text = path.read_text(errors="ignore")
        for match in PATH_REF.finditer(text):
            ref, anchor = match.group(1), match.group(2)
            beside = (path.parent / ref).resolve()
            if ref.startswith("../") and root.resolve() in beside.parents:
                name = beside.relative_to(root.resolve()).as_posix()  # a Markdown link's relative path
            else:
                name = ref.removeprefix("./")
            for installed, folder in installed_as.items():
                name = folder + name.removeprefix(installed) if name.startswith(installed) else name
            if name.startswith(ELSEWHERE) or any(
                part.startswith(("my_", "mylab")) for part in name.split("/")
            ):
                continue
            target = endings.get(name)
            where = f"{path.relative_to(root)}:{text.count(chr(10), 0, match.start()) + 1}"
            if target is None:
                problems.append(f"{where}: {ref} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                problems.append(f"{where}: {ref}#{anchor} (no such heading)")
    return problems


def test_paths_named_in_the_sources_exist() -> None:
    # this file's own strings are the checkers' fixtures
    assert stale_paths(skip=frozenset({Path(__file__).resolve()})) == []


def test_the_path_checker_reports_missing_files_and_headings(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "mod.py").write_text('"""See ``sub/mod.py`` and docs/guide.md#usage."""\n')
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text(
        "# Usage\nRun `labrl/pkg/sub/mod.py`, then megatron/core/utils.py; write configs/my_run.yaml.\n"
        "See ARCHITECTURE.md, docs/guide.md#setup and pkg/sub/gone.py.\n"
    )
    assert stale_paths(tmp_path, installed_as={"labrl/pkg/": "pkg/"}) == [
        "docs/guide.md:3: ARCHITECTURE.md (no such file)",
        "docs/guide.md:3: docs/guide.md#setup (no such heading)",
        "docs/guide.md:3: pkg/sub/gone.py (no such file)",
    ]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_the_checker_reports_missing_files_and_headings(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Title (`x.y`)\n## Same\n## Same\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](other.md#title-xy) [ok](other.md#same-1) [ok](#here) [web](https://example.org/x)\n"
        "# Here\n```\n[in a fence](missing.md)\n```\n`[in code](missing.md)`\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [away](../elsewhere/x.md)\n"
    )
    assert broken_links(doc, root=tmp_path) == [
        "doc.md: missing.md (no such file)",
        "doc.md: other.md#nope (no such heading)",
        "doc.md: ../elsewhere/x.md (outside the repository)",
    ]


def test_the_readme_is_a_front_page_not_the_manual() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.splitlines()[2:6] == [
        "```bash",
        "make run     # main job: RL quickstart, a tiny MoE learns XRD phase identification on CPU (~10-15 min)",
        "make test    # the test suite (what CI runs: .ci/run)",
        "```",
    ]
    assert len(readme.splitlines()) <= 250
