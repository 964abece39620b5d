"""Reading a Dockerfile the way the image tests need: instructions and ARG defaults."""

from __future__ import annotations

import re
from pathlib import Path


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def arg_defaults(path: Path) -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in instructions(path) if word == "ARG" and "=" in rest)
