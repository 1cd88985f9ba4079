"""The documentation: the README stays short, every relative link resolves inside the
repository (anchors included), and no page spells an import or a command the way the project
did before it became the one ``bitps`` namespace."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250


def _pages() -> list[Path]:
    """Every Markdown page the checks cover."""
    pages = [ROOT / "README.md", ROOT / "docker" / "README.md",
             *sorted((ROOT / "docs").glob("*.md"))]
    return [p for p in pages if p.is_file()]


PAGES = _pages()

_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) or ![alt](target), target optionally followed by a "title"
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_SCHEMES = ("http://", "https://", "mailto:")


def _lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(2)
            continue
        if fence is not None:
            closing = line.strip()
            if closing.startswith(fence) and set(closing) == {fence[0]}:
                fence = None
            continue
        lines.append((number, line))
    return lines


def _links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and link definition in prose."""
    found = []
    for number, line in _lines(path.read_text(encoding="utf-8")):
        prose = _INLINE_CODE.sub("", line)
        found += [(number, m.group(1)) for m in _LINK.finditer(prose)]
        if m := _REF_DEF.match(prose):
            found.append((number, m.group(1)))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed (word
    characters, spaces and hyphens stay), spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def page_anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown page, repeated headings numbered as GitHub does."""
    seen: dict[str, int] = {}
    result = set()
    for _, line in _lines(path.read_text(encoding="utf-8")):
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    return result


def link_problem(page: Path, target: str) -> str | None:
    """What is wrong with one link target on ``page``, or ``None``."""
    if target.startswith(_SCHEMES):
        return None
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
        return "a URL scheme other than http(s) or mailto"
    path_part, _, anchor = target.partition("#")
    path_part = unquote(path_part)
    if not path_part:
        if anchor and anchor not in page_anchors(page):
            return f"no heading with anchor #{anchor} on this page"
        return None
    if path_part.startswith("/"):
        return "an absolute path (write it relative to the page)"
    resolved = (page.parent / path_part).resolve()
    try:
        resolved.relative_to(ROOT)
    except ValueError:
        return "a path outside the repository"
    if not resolved.exists():
        return "a path that does not exist"
    if anchor and resolved.suffix == ".md":
        if anchor not in page_anchors(resolved):
            return f"no heading with anchor #{anchor} in {resolved.relative_to(ROOT)}"
    return None


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; at most {README_MAX_LINES} (details go to docs/)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for number, target in _links(page):
        if problem := link_problem(page, target):
            bad.append(f"{page.relative_to(ROOT)}:{number}: ({target}) is {problem}")
    assert not bad, "\n".join(bad)


# Spellings from before the one installed namespace: the top-level folders imported or run as
# packages of their own (``from worker import ...``, ``python -m ps``, `ps.store`).
_OLD = "ps|worker|proto|native|bench"
_OLD_SPELLINGS = re.compile(
    rf"\bfrom\s+(?:{_OLD})(?:\.\w+)*\s+import\b"
    rf"|(?<![\w.])import\s+(?:{_OLD})\b(?!-)"
    rf"|\bpython3?\s+-m\s+(?:{_OLD})\b(?![-/])"
    rf"|`(?:{_OLD})\.[A-Za-z_]\w*")


def old_spellings(text: str) -> list[str]:
    return [m.group(0) for m in _OLD_SPELLINGS.finditer(text)]


def _namespace_pages() -> list[Path]:
    return [p for p in [ROOT / "README.md", ROOT / "docker" / "README.md",
                        *sorted((ROOT / "docs").rglob("*.md"))] if p.is_file()]


@pytest.mark.parametrize("page", _namespace_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_pre_namespace_spellings(page):
    bad = []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        bad += [f"{page.relative_to(ROOT)}:{number}: {s!r}" for s in old_spellings(line)]
    assert not bad, "use bitps.<subpackage> / from bitps import ...:\n" + "\n".join(bad)


@pytest.mark.parametrize("text, old", [
    ("from worker import PSModel", True),
    ("from worker.config import PoolConfig", True),
    ("import ps", True),
    ("python -m ps --mode sync", True),
    ("python3 -m bench.gpu_check", True),
    ("raised as `proto.PSError`", True),
    ("from bitps import PSModel", False),
    ("from bitps.worker.config import PoolConfig", False),
    ("import bitps.ps", False),
    ("python -m bitps.ps", False),
    ("python -m bitps.bench.gpu_check", False),
    ("`ps/store.py` and `worker/training/comm.py`", False),
    ("ps and worker never import each other", False),
])
def test_old_spelling_pattern(text, old):
    assert bool(old_spellings(text)) is old


@pytest.mark.parametrize("heading, expected", [
    ("Quick start", "quick-start"),
    ("`bitps-bench e2e`: does the job finish sooner than with DDP?",
     "bitps-bench-e2e-does-the-job-finish-sooner-than-with-ddp"),
    ("1-bit Adam (sync, async/ssp)", "1-bit-adam-sync-asyncssp"),
    ("The 28.6 M LM, 1 Gbit/s, 2 workers", "the-286-m-lm-1-gbits-2-workers"),
    ("Straggler: worker 1 computes 1.5× slower", "straggler-worker-1-computes-15-slower"),
])
def test_slug_matches_github(heading, expected):
    assert slug(heading) == expected


def test_link_check_refuses_escapes_and_missing():
    page = ROOT / "README.md"
    assert link_problem(page, "../shared/DESIGN.md") == "a path outside the repository"
    assert link_problem(page, "docs/no-such-page.md") == "a path that does not exist"
    assert link_problem(page, "https://example.org/x") is None
    assert link_problem(page, "docker/") is None
    assert "no heading" in link_problem(page, "docs/design.md#no-such-heading-here")
