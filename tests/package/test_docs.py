"""The documentation for readers: README.md and docs/ tell no history (the narrative of past runs,
bugs and issue numbers lives in git and in docs/measured/), README.md stays short, and every
relative link in them names a file that exists."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MEASURED = REPO / "docs" / "measured"
#: phrases that tell history rather than state what is (issue 40's check, plus "issue #11" forms)
HISTORY = re.compile(r"first run|second run|third run|fourth run|fifth run|since 20[0-9]{2}-|now fixed"
                     r"|issue [0-9]+|issue #[0-9]+")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _reader_docs():
    docs = [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))
    return [p for p in docs if MEASURED not in p.parents]


def _all_docs():
    return [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))


@pytest.mark.parametrize("path", _reader_docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_history_in_reader_docs(path):
    found = [f"{path.name}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
             if HISTORY.search(line)]
    assert not found, "\n".join(found)


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)


@pytest.mark.parametrize("path", _all_docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    missing = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = target.split("#", 1)[0]
        if not (path.parent / file).exists():
            missing.append(target)
    assert not missing, missing


def test_the_check_can_fail(tmp_path):
    """The patterns catch what they are for, and the link check sees a missing file."""
    assert HISTORY.search("measured in the fifth run") and HISTORY.search("see issue #11")
    assert not HISTORY.search("measured on 2026-11-27")
    page = tmp_path / "page.md"
    page.write_text("[x](missing.md) [y](https://example.com) [z](#anchor)")
    assert LINK.findall(page.read_text()) == ["missing.md", "https://example.com", "#anchor"]
    assert not (tmp_path / "missing.md").exists()
