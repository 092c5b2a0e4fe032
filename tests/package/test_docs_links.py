"""Every relative link (and its #anchor) in README.md, docs/*.md and benchmarks/README.md resolves
inside the repository."""

from __future__ import annotations

import re
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
