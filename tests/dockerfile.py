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


def installed_extras(runs: str, optional_dependencies: dict[str, list[str]]) -> set[str]:
    """The extras a RUN text installs or builds (`".[a,b]"`, `"tensorfleet[a]"`,
    `"/opt/src[a]"`), with the extras they name of tensorfleet itself expanded."""
    named = {name.strip() for group in re.findall(r"[\w./-]*\[([\w,\s-]+)\]", runs) for name in group.split(",")}
    return expand_extras(named, optional_dependencies)


def expand_extras(names: set[str], optional_dependencies: dict[str, list[str]]) -> set[str]:
    """NAMES plus every extra they pull in through `tensorfleet[...]` requirements."""
    out: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        for requirement in optional_dependencies.get(name, []):
            match = re.fullmatch(r"tensorfleet\[([\w,\s-]+)\]", requirement.strip())
            if match:
                todo += [part.strip() for part in match.group(1).split(",")]
    return out
