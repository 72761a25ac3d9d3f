"""The two runs of TRL's tests and their comparison: the test files copied as they are and with the one import changed
(:func:`with_hflight`), pytest run on each side with the stand-ins' environment (:func:`run_side`), the junit reports
read back (:func:`outcomes`) and set side by side (:func:`table`)."""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

SIDES = ("trl", "hflight")
#: the package name TRL's test folder takes in each side's copy (not ``tests``: this project's is on the path)
PACKAGE = "trl_tests"
#: TRL's test support files the test modules import or pytest loads beside them
SUPPORT = ("__init__.py", "conftest.py", "testing_utils.py", "testing_constants.py", "data")
PROJECT = Path(__file__).resolve().parents[2]
FAILED = ("failed", "error")
CATEGORIES = ("pass both", "fail both", "pass only with TRL", "pass only with hflight.trl", "skipped both", "differ")


def exported() -> frozenset[str]:
    """The names ``hflight.trl`` exports in TRL's place (its trainers and configs)."""
    import hflight.trl

    return frozenset(hflight.trl.TRAINERS + hflight.trl.CONFIGS)


def with_hflight(source: str, names: frozenset[str]) -> tuple[str, int]:
    """``source`` with the one import changed: each ``from trl import ...`` takes the names in ``names`` from
    ``hflight.trl`` instead (the others stay TRL's), and each ``trl.<name>`` of a module that imports ``trl`` becomes
    ``hflight.trl.<name>``; everything else unchanged. Returns the source and the number of changes."""
    tree = ast.parse(source)
    edits = []  # (line, column, end line, end column, replacement), applied from the end
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "trl" and node.level == 0:
            ours = [alias for alias in node.names if alias.name in names]
            if not ours:
                continue
            theirs = [alias for alias in node.names if alias.name not in names]
            spell = lambda aliases: ", ".join(ast.unparse(alias) for alias in aliases)  # noqa: E731
            indent = " " * node.col_offset
            text = f"from hflight.trl import {spell(ours)}"
            if theirs:
                text = f"from trl import {spell(theirs)}\n{indent}{text}"
            edits.append((node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, text))
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trl"
              and node.attr in names):  # fmt: skip
            edits.append(
                (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, f"hflight.trl.{node.attr}")
            )
    binding = [node for node in ast.walk(tree) if isinstance(node, ast.Import)
               and any(a.asname is None and a.name.split(".")[0] == "trl" for a in node.names)]  # fmt: skip
    if binding and any(text.startswith("hflight.trl.") for *_, text in edits):
        end = (binding[0].end_lineno, binding[0].end_col_offset)
        edits.append((*end, *end, f"\n{' ' * binding[0].col_offset}import hflight.trl  # the one import changed"))
    return replace(source, edits), len(edits)


def adapt_to_installed_trl(source: str) -> tuple[str, list[str]]:
    """``source`` (a file of TRL's tests) with each name it imports from a TRL module that the installed TRL lacks
    taken from :func:`tests.trl_upstream.plugin.missing_in_installed_trl` instead, on both sides alike (the tests
    are of an older TRL: without this a whole file would fail to import); returns the source and those names."""
    edits, missing = [], []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "trl"):
            continue
        module = importlib.import_module(node.module)
        gone = [alias for alias in node.names if not hasattr(module, alias.name)]
        if not gone:
            continue
        kept = [alias for alias in node.names if hasattr(module, alias.name)]
        indent = " " * node.col_offset
        text = [f"from {node.module} import {', '.join(ast.unparse(a) for a in kept)}"] if kept else []
        text.append("from tests.trl_upstream.plugin import missing_in_installed_trl")
        text += [f"{a.asname or a.name} = missing_in_installed_trl({node.module + '.' + a.name!r})" for a in gone]
        edits.append((node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, f"\n{indent}".join(text)))
        missing += [f"{node.module}.{a.name}" for a in gone]
    return replace(source, edits), missing


def replace(source: str, edits: list[tuple[int, int, int, int, str]]) -> str:
    """``source`` with each (line, column, end line, end column) span replaced by its text (ast's positions)."""
    changed = source.encode("utf-8")  # ast's columns count UTF-8 bytes
    for line, column, end_line, end_column, text in sorted(edits, reverse=True):
        lines = changed.splitlines(keepends=True) or [b""]
        head = b"".join(lines[: line - 1]) + lines[line - 1][:column]
        tail = lines[end_line - 1][end_column:] + b"".join(lines[end_line:])
        changed = head + text.encode("utf-8") + tail
    return changed.decode("utf-8")


def copy_side(trl_tests: Path, side_root: Path, files: list[str], names: frozenset[str] | None) -> None:
    """TRL's support files and the selected test files in ``side_root/trl_tests``, adapted to the installed TRL
    (:func:`adapt_to_installed_trl`, the names listed in ``adapted.txt``) and changed with :func:`with_hflight` when
    ``names`` is given; a test file whose import nothing changed is refused (it would run TRL on both sides)."""
    shutil.rmtree(side_root, ignore_errors=True)
    package = side_root / PACKAGE
    package.mkdir(parents=True)
    for support in SUPPORT:
        source = trl_tests / support
        if source.is_dir():
            shutil.copytree(source, package / support)
        elif source.is_file():
            shutil.copy2(source, package / support)
    adapted = []
    for name in [*(["testing_utils.py"] if (trl_tests / "testing_utils.py").is_file() else []), *files]:
        text, missing = adapt_to_installed_trl((trl_tests / name).read_text(encoding="utf-8"))
        adapted += [f"{name}: {qualified}" for qualified in missing]
        if names is not None and name != "testing_utils.py":
            text, changes = with_hflight(text, names)
            if not changes:
                raise ValueError(f"{name}: imports no trainer or config of TRL's that hflight.trl exports")
        (package / name).write_text(text, encoding="utf-8")
    (side_root / "adapted.txt").write_text("".join(line + "\n" for line in adapted), encoding="utf-8")
    (side_root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n", encoding="utf-8")


def side_command(side_root: Path, files: list[str], workers: int, select: str | None) -> list[str]:
    command = [sys.executable, "-m", "pytest", "-p", "tests.trl_upstream.plugin", "-q", "-rN",
               f"--junitxml={side_root / 'junit.xml'}", *(f"{PACKAGE}/{name}" for name in files)]  # fmt: skip
    if workers:
        command += ["-n", str(workers)]
    if select:
        command += ["-k", select]
    return command


def side_environment(standins: dict[str, str], timeout: int) -> dict[str, str]:
    """The test processes' environment: the stand-ins', this project importable (the plugin), CPU only, a thread per
    process."""
    path = os.pathsep.join(p for p in (str(PROJECT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **standins, "PYTHONPATH": path, "HFLIGHT_TRL_TEST_TIMEOUT": str(timeout),
            "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
            "WANDB_MODE": "disabled", "PYTHONHASHSEED": "0"}  # fmt: skip


def run_sides(
    out: Path,
    trl_tests: Path,
    files: list[str],
    standins: dict[str, str],
    *,
    sides=SIDES,
    workers: int = 0,
    timeout: int = 300,
    select: str | None = None,
) -> None:
    """Both sides at once (a process each, ``workers`` more each with pytest-xdist), their logs in
    ``out/<side>/pytest.log``."""
    running = {}
    for side in sides:
        root = out / side
        copy_side(trl_tests, root, files, exported() if side == "hflight" else None)
        log = (root / "pytest.log").open("w", encoding="utf-8")
        environment = side_environment(standins, timeout)
        command = side_command(root, files, workers, select)
        running[side] = subprocess.Popen(command, cwd=root, stdout=log, stderr=subprocess.STDOUT, env=environment)
    for process in running.values():
        process.wait()


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """``file::Class::test`` -> (outcome, first line of its message) from a junit report; outcome is passed, failed,
    error or skipped."""
    found = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        parts = [*case.get("classname", "").split("."), case.get("name", "")]
        module = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
        test_id = "::".join([parts[module].removesuffix(".py") + ".py", *parts[module + 1 :]])
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (element.get("message") or element.text or "").strip().splitlines()[:1]
                message = message[0][:300] if message else ""
                break
        if found.get(test_id, ("passed",))[0] == "passed" or outcome in FAILED:  # a teardown error counts
            found[test_id] = (outcome, message)
    return found


def category(theirs: str | None, ours: str | None) -> str:
    if theirs == "passed" and ours == "passed":
        return "pass both"
    if theirs == "passed":
        return "pass only with TRL"
    if ours == "passed":
        return "pass only with hflight.trl"
    if theirs in FAILED and ours in FAILED:
        return "fail both"
    if theirs == "skipped" and ours == "skipped":
        return "skipped both"
    return "differ"


def table(results: dict[str, dict[str, tuple[str, str]]]) -> tuple[str, dict[str, Counter], list[str]]:
    """The markdown table of every test's outcome on both sides, the counts of each category per file, and the tests
    that pass with TRL and not with hflight.trl."""
    theirs, ours = results["trl"], results["hflight"]
    counts: dict[str, Counter] = {}
    rows = ["| test | TRL | hflight.trl | message (hflight.trl's, else TRL's) |", "|---|---|---|---|"]
    regressions = []
    for test_id in sorted(theirs.keys() | ours.keys()):
        a, b = theirs.get(test_id, ("missing", "")), ours.get(test_id, ("missing", ""))
        kind = category(a[0], b[0])
        counts.setdefault(test_id.split("::")[0], Counter())[kind] += 1
        if kind == "pass only with TRL":
            regressions.append(test_id)
        message = b[1] if b[0] in FAILED else a[1] if a[0] in FAILED else ""
        rows.append(f"| `{test_id}` | {a[0]} | {b[0]} | {message.replace('|', '/')} |")
    return "\n".join(rows) + "\n", counts, regressions
