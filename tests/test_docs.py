"""The documentation holds together: the README is the front door (short, the two commands
.ci/run checks, a link to every topic's page), every relative link and anchor in the
markdown resolves, and every ``docs/<page>.md[#section]`` that a flag's help, a docstring
or an error message names exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["getting-started", "data", "rewards", "environments", "gpus", "slurm", "kubernetes", "failures",
          "security", "dashboard", "architecture",
          "simulator"]
"""The pages the README links one paragraph each to (issue 28), besides benchmarks/README.md."""

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"`+[^`]*`+")
DOC_REF = re.compile(r"docs/([a-z0-9-]+\.md)(#[a-z0-9_-]+)?")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and
    underscores kept), spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file, duplicates numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose_lines(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """The relative links of a markdown file whose target file or anchor does not exist."""
    broken = []
    for line in _prose_lines(path.read_text()):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{target} (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{target} (no such section)")
    return broken


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted(ROOT.glob("*/README.md"))]
    return [f for f in files if f.exists()]


def test_the_readme_is_short_and_says_the_two_commands_ci_runs_in_its_first_40_lines():
    ci = (ROOT / ".ci" / "run").read_text()
    setup = shlex.split(re.search(r"^SETUP=(.*)$", ci, re.M).group(1))[0]
    test = shlex.split(re.search(r"^TEST=(.*)$", ci, re.M).group(1))[0]
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the manual belongs in docs/"
    # .ci/run greps for these whole lines (grep -qxF): exactly, and near the top.
    assert f"{setup} && torchx run" in lines[:40]
    assert test in lines[:40]


def test_the_readme_links_every_topic_page_and_the_benchmarks():
    readme = (ROOT / "README.md").read_text()
    for topic in TOPICS:
        assert (ROOT / "docs" / f"{topic}.md").exists(), topic
        assert f"(docs/{topic}.md" in readme, f"the README does not link docs/{topic}.md"
    assert "(benchmarks/README.md)" in readme


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path):
    assert broken_links(path) == [], f"{path.relative_to(ROOT)}: broken links"


def test_a_broken_link_or_anchor_is_found(tmp_path):
    """The check itself: a missing file, a missing section, and what resolves."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` section: here\n\n## Dup\n\n## Dup\n")
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\n[ok](other.md) [ok](other.md#a-code-section-here) [ok](#title)\n"
                   "[ok](other.md#dup-1) [ok](https://example.com/x.md) `[not a link](gone.md)`\n"
                   "```\n[in a code block](gone.md)\n```\n"
                   "[bad](gone.md) [bad](other.md#nowhere) [bad](#nowhere)\n")
    assert broken_links(doc) == ["gone.md (no such file)", "other.md#nowhere (no such section)",
                                 "#nowhere (no such section)"]


def test_every_docs_page_and_section_the_code_points_to_exists():
    """Flags' help texts (config field docstrings), docstrings and error messages send the
    reader to ``docs/<page>.md`` or ``docs/<page>.md#<section>``: each must exist (a help
    once pointed to "README, Devices", a section that was called GPUs)."""
    pointed = set()
    for folder in ("app", "components", "pipelines", "dashboard", "benchmarks", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == Path(__file__).name:
                continue
            pointed |= {(page, anchor) for page, anchor in DOC_REF.findall(path.read_text())}
    assert pointed, "the pattern finds the references"
    missing = [f"docs/{page}{anchor}" for page, anchor in sorted(pointed)
               if not (ROOT / "docs" / page).exists()
               or (anchor and anchor[1:] not in anchors(ROOT / "docs" / page))]
    assert missing == [], f"no such docs page or section: {missing}"


def test_no_code_or_doc_points_to_a_readme_section():
    """The README is no longer the manual: "README, <section>" pointers go to docs/ pages."""
    hits = []
    for folder in ("app", "components", "pipelines", "dashboard"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            hits += [f"{path.relative_to(ROOT)}: {m}" for m in re.findall(r"README, [A-Z][A-Za-z ]*", path.read_text())]
    for path in (ROOT / "docs").glob("*.md"):
        hits += [f"{path.relative_to(ROOT)}: {m}" for m in re.findall(r"README, [A-Z][A-Za-z ]*", path.read_text())]
    assert hits == []
