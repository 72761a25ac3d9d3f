"""The commands README.md and the guides in docs/ show, read from their fenced ``bash`` blocks.

Standard library only: ``.ci/run`` calls it before any environment exists, to run the README's test line itself
(``python3 tests/readme.py suite-command``); ``tests/test_readme_commands.py`` runs the Hydra commands of every
document (:func:`documents`).

A command is one line of a ``bash`` block (a line ending in ``\\`` continues on the next); ``#`` starts a comment
(a whole line, or after a space); ``&&`` splits a command into steps, which is what the tests classify and run.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_COMMENT = re.compile(r"(^|\s)#.*$")


@dataclass(frozen=True)
class Step:
    """One ``&&``-separated step of a README command, as written (continuation lines joined by one space)."""

    text: str
    line: int  # line of its document on which its command starts
    command: str  # the whole command it belongs to
    document: str = "README.md"  # where it is shown, relative to the repository

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line}"


def documents() -> dict[str, str]:
    """``{path relative to the repository: text}`` of README.md and every ``docs/*.md``, README first."""
    paths = [README, *sorted(DOCS.glob("*.md"))]
    return {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8") for path in paths}


def fenced_blocks(text: str, language: str) -> list[tuple[int, list[str]]]:
    """``(first line number, lines)`` of every fenced block of ``language``, its indentation removed."""
    blocks: list[tuple[int, list[str]]] = []
    block: list[str] | None = None
    indent, keep, start = "", False, 0
    for number, line in enumerate(text.splitlines(), start=1):
        fence = _FENCE.match(line)
        if fence and block is None:
            indent, keep, start, block = fence.group(1), fence.group(2) == language, number + 1, []
        elif fence and not fence.group(2):
            if keep:
                blocks.append((start, block))
            block = None
        elif block is not None:
            block.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
    return blocks


def commands(text: str) -> list[tuple[int, str]]:
    """``(line number, command)`` for every command of the ``bash`` blocks, comments removed."""
    found: list[tuple[int, str]] = []
    for start, lines in fenced_blocks(text, "bash"):
        pending: list[str] = []
        first = start
        for offset, raw in enumerate(lines):
            line = _COMMENT.sub("", raw).rstrip()
            if not pending:
                first = start + offset
            if line.endswith("\\"):
                pending.append(line[:-1].strip())
                continue
            pending.append(line.strip())
            command = " ".join(part for part in pending if part)
            pending = []
            if command:
                found.append((first, command))
    return found


def steps(text: str, document: str = "README.md") -> list[Step]:
    """Every ``&&``-separated step of every command of ``text`` (the document ``document``), in order."""
    return [
        Step(part.strip(), line, command, document)
        for line, command in commands(text)
        for part in command.split("&&")
        if part.strip()
    ]


def suite_command(text: str) -> str:
    """The README's one command that runs the test suite (the "Run the tests" line)."""
    lines = [command for _, command in commands(text) if "-m pytest" in command]
    if len(lines) != 1:
        raise ValueError(f"README.md should show exactly one command running `python -m pytest`, found {lines}")
    return lines[0]


if __name__ == "__main__":
    if sys.argv[1:] != ["suite-command"]:
        sys.exit("usage: python3 tests/readme.py suite-command")
    print(suite_command(README.read_text(encoding="utf-8")))
