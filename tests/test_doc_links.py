"""Every `docs/FILE.md` and `docs/FILE.md#anchor` named in the package's source (docstrings and comments) exists:
the file, and a heading in it that GitHub slugs to the anchor."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "operator" / "tensorfleet"

# `docs/x.md` or `docs/x.md#anchor`, not inside a longer path or URL (`https://.../docs/x.md` is someone else's).
LINK = re.compile(r"(?<![\w/.-])docs/([\w./-]+?\.md)(?!\w)(?:#([\w-]+))?")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
MARKDOWN_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lowercase, stripped, every character but letters, digits, spaces,
    '-' and '_' dropped, spaces to '-'. A link in the heading counts as its text."""
    text = MARKDOWN_LINK.sub(r"\1", heading).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The anchors of a Markdown file's ATX headings (outside fenced code), the second and later of one slug
    suffixed -1, -2, ... as GitHub does."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fence: str | None = None
    for line in markdown.splitlines():
        opened = FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = None
            continue
        if opened:
            fence = opened.group(1)
            continue
        match = HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(package: Path, root: Path) -> list[str]:
    """`path:line -> link` for every docs link in package's .py files whose file or heading is missing."""
    cache: dict[Path, set[str] | None] = {}
    broken = []
    for source in sorted(package.rglob("*.py")):
        for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
            for match in LINK.finditer(line):
                doc = root / "docs" / match.group(1)
                if doc not in cache:
                    cache[doc] = anchors(doc.read_text(encoding="utf-8")) if doc.is_file() else None
                headings = cache[doc]
                anchor = match.group(2)
                if headings is None or (anchor is not None and anchor not in headings):
                    broken.append(f"{source.relative_to(root)}:{number} -> {match.group(0)}")
    return broken


def test_slug_follows_github() -> None:
    assert slug("The planner: from a spec to vLLM's two start-up figures") == (
        "the-planner-from-a-spec-to-vllms-two-start-up-figures")
    assert slug("Free bytes per GPU (`planner/memory.py`)") == "free-bytes-per-gpu-plannermemorypy"
    assert slug("  `cache-aware` (the default) ") == "cache-aware-the-default"
    assert slug("Prefill/decode disaggregation") == "prefilldecode-disaggregation"
    assert slug("snake_case and [a link](x.md)") == "snake_case-and-a-link"
    assert slug("A  B") == "a--b"


def test_anchors_number_duplicates_and_skip_code() -> None:
    text = "# Top\n## Limits\n```sh\n# not a heading\n```\n## Limits\n### Limits ###\n~~~\n## Inside\n~~~\n"
    assert anchors(text) == {"top", "limits", "limits-1", "limits-2"}


def test_broken_links_are_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n## Part one\n")
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(
        '"""Design: docs/a.md#part-one."""\n'
        "# see docs/a.md, docs/a.md#part-two and docs/b.md#x; not https://example.com/docs/c.md\n")
    assert broken_links(package, tmp_path) == ["pkg/m.py:2 -> docs/a.md#part-two", "pkg/m.py:2 -> docs/b.md#x"]


def test_docs_links_in_the_package_exist() -> None:
    broken = broken_links(PACKAGE, ROOT)
    assert not broken, "docs links with no such file or heading:\n" + "\n".join(broken)
