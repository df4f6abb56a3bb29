"""README.md and docs/*.md as the tests read them: headings and their GitHub anchors, tables under a
heading, fenced code blocks with the `<!-- example: TAG -->` marker before them, links."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

_FENCE = re.compile(r"^(`{3,})(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*example:\s*([\w-]+)\s*-->$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int          # the line of the opening fence, 1-based
    lang: str
    text: str
    tag: str | None    # the example marker's tag, None when there is none

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def code_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        fence, lang, start = opening.group(1), opening.group(2), index
        index += 1
        body = []
        while index < len(lines) and lines[index].strip() != fence:
            body.append(lines[index])
            index += 1
        index += 1
        before = next((lines[i].strip() for i in range(start - 1, -1, -1) if lines[i].strip()), "")
        marker = _MARKER.match(before)
        blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n", marker.group(1) if marker else None))
    return blocks


def prose(path: Path) -> str:
    """The text outside fenced blocks, inline code replaced by spaces (neither holds links); a
    fenced line becomes an empty one, so line numbers stay the file's."""
    return "\n".join(re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), line)
                     for line in prose_with_code(path).splitlines())


def headings(path: Path) -> list[str]:
    return [m.group(2).strip() for m in re.finditer(r"^(#{1,6})\s+(.+)$", prose_with_code(path), re.M)]


def prose_with_code(path: Path) -> str:
    """The text outside fenced blocks (inline code kept: headings have it); a fenced line becomes an
    empty one, so line numbers stay the file's."""
    kept, fence = [], None
    for line in path.read_text().splitlines():
        opening = _FENCE.match(line) if fence is None else None
        if opening:
            fence = opening.group(1)
        elif fence is not None and line.strip() == fence:
            fence = None
        elif fence is None:
            kept.append(line)
            continue
        kept.append("")
    return "\n".join(kept)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in headings(path):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        found.add(anchor if count == 0 else f"{anchor}-{count}")
        seen[anchor] = count + 1
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every markdown link in the prose."""
    found = []
    for number, line in enumerate(prose(path).splitlines(), start=1):
        found += [(number, m.group(1)) for m in re.finditer(r"\]\(([^)\s]+)\)", line)]
    return found


def tables(path: Path) -> dict[str, list[list[str]]]:
    """Heading -> the rows of the first table under it (header row first, separator dropped)."""
    found: dict[str, list[list[str]]] = {}
    heading = None
    rows: list[list[str]] = []
    for line in prose_with_code(path).splitlines() + [""]:
        match = re.match(r"^#{1,6}\s+(.+)$", line)
        if match:
            heading, rows = match.group(1).strip(), []
            continue
        if line.startswith("|"):
            cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not all(re.fullmatch(r":?-+:?", cell) for cell in cells):
                rows.append(cells)
            continue
        if rows and heading is not None and heading not in found:
            found[heading] = rows
        rows = [] if not line.startswith("|") else rows
    return found


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)
