"""The repository stands alone: a fresh clone with nothing beside it builds, tests and documents itself. So no
tracked file may name a path outside it (the shared folder the fixtures and design notes once came from, an
absolute path of one machine), and every relative link of its Markdown must land on a file inside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"\.\./shared\b|/work/|/home/[a-z]|/Users/[A-Za-z]|DESIGN(\.md| §)".encode())
"""Paths of one machine, and the design notes outside the repository (now docs/), by name or by section."""
LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]*))?\)")


def _tracked() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in listed.decode().split("\0") if name]


TRACKED = _tracked()
THIS = Path(__file__).resolve()


def test_no_tracked_file_names_a_path_outside_the_repository() -> None:
    assert len(TRACKED) > 100, "git ls-files listed too little: not a checkout?"
    offenders = []
    for path in TRACKED:
        if path == THIS or not path.is_file():
            continue
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.decode(errors='replace')[:120]}")
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)


def anchors(doc: Path) -> set[str]:
    """What `doc.md#fragment` can name: explicit `<a id>`s and the ids GitHub gives headings."""
    text = doc.read_text()
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
    return slugs | set(re.findall(r'<a id="([^"]+)"', text))


@pytest.mark.parametrize("doc", [p for p in TRACKED if p.suffix == ".md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_markdown_link_lands_inside_the_repository(doc: Path) -> None:
    dead = []
    for target, fragment in LINK.findall(doc.read_text()):
        if re.match(r"[a-z][a-z+]*:", target):  # http:, https:, mailto: ... : not a path
            continue
        resolved = (doc.parent / target).resolve() if target else doc  # `(#fragment)`: this document
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            dead.append(target)
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            dead.append(f"{target}#{fragment}")
    assert not dead, f"{doc.relative_to(ROOT)}: links outside the repository or to nothing: {dead}"


def test_every_fixture_folder_says_where_it_came_from() -> None:
    """A capture copied in without its provenance (which engine and version, how captured) cannot be judged when
    it and the code disagree: each folder has a README.md of its own or a `## folder` section in the top one."""
    fixtures = ROOT / "tests" / "fixtures"
    sections = set(re.findall(r"^## ([\w.-]+)/", (fixtures / "README.md").read_text(), re.M))
    folders = [p for p in fixtures.iterdir() if p.is_dir()]
    undocumented = [p.name for p in folders if not (p / "README.md").exists() and p.name not in sections]
    assert folders and not undocumented, f"fixture folders with no provenance note: {undocumented}"


@pytest.mark.parametrize("doc", [p for p in TRACKED if p.suffix == ".md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_a_document_cites_exists(doc: Path) -> None:
    """docs/ cite the module behind each statement: a module renamed or removed must take its citations along."""
    cited = re.findall(r"`((?:kvctl|tests|benchmarks|docs)/[^`\s{}*<]*)`", doc.read_text())
    missing = sorted({path for path in cited if not (ROOT / path.partition("#")[0]).exists()})  # a section's anchor
    assert not missing, f"{doc.relative_to(ROOT)} cites paths that do not exist: {missing}"
