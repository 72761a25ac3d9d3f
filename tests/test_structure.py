"""The design's rules, checked on the source (issue 15): collaborators never touch the facade's private state, the
package's imports form a DAG, and sizes stay small.

- Outside ``trainer.py`` no module reads or writes an attribute of the facade whose name starts with ``_``, except
  transformers' protected override points listed once in ``hflight.surface.OVERRIDE_POINTS``. A "facade" is any
  expression other than ``self``/``cls`` of a class that is not a facade (``facade._x``, ``self.facade._x``,
  ``trainer._x``, ``getattr(trainer, "_x")``), and ``self``/``super()`` inside a subclass of the facade
  (``MRCTrainer``, ``IPUTrainer``, ``ORTTrainer``) or a mixin the facade is built from (``optim.OptimizerMixin``,
  ...), for the facade's own private names. A subclass may not override a private facade method either (that couples
  it to internals the same way).
- Every ``import`` statement inside ``hflight`` (type-only and function-level ones included) is an edge; the graph
  has no cycle, and the layers hold: backends and the Lightning pieces import neither ``hflight.run`` nor
  ``hflight.trainer``.
- ``trainer.py`` has at most 400 lines; no function in ``src/`` is longer than 60 lines (``def`` to last line).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import transformers

import hflight
from hflight.surface import OVERRIDE_POINTS
from hflight.trainer.facade import Trainer

SRC = Path(hflight.__file__).parent
FACADE_FILE = SRC / "trainer.py"
# Names that denote the facade wherever they appear as the object of an attribute access.
FACADE_NAMES = {"facade", "hf_trainer"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _source_files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py"))


def facade_private_names() -> set[str]:
    """Private (single-underscore) names of the facade's own state: the methods and class attributes ``trainer.py``
    defines, and every ``self._x`` attribute it assigns. (A mixin's own helpers, such as ``hub.HubMixin``'s
    ``_finish_current_push``, belong to the mixin.)"""
    names = {
        n
        for n in dir(Trainer)
        if n.startswith("_") and not n.startswith("__") and next(k for k in Trainer.__mro__ if n in vars(k)) is Trainer
    }
    for node in ast.walk(ast.parse(FACADE_FILE.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                names.add(node.attr)
    return names


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _names_facade(node: ast.AST) -> bool:
    """``facade``, ``self.facade``, ``self._facade``, ``run.facade``, ... : an expression naming the facade."""
    if isinstance(node, ast.Name):
        return node.id in FACADE_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr.lstrip("_") in FACADE_NAMES
    return False


class _Checker(ast.NodeVisitor):
    """Collects ``(line, text)`` for every facade-private access in one module."""

    def __init__(self, private: set[str], facade_classes: set[str]) -> None:
        self.private = private
        self.facade_classes = facade_classes  # names of the classes in this module that subclass the facade
        self.classes: list[str] = []
        self.found: list[tuple[int, str]] = []

    def _in_facade_subclass(self) -> bool:
        return bool(self.classes) and self.classes[-1] in self.facade_classes

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        if node.name in self.facade_classes:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in self.private:
                    if item.name not in OVERRIDE_POINTS:
                        self.found.append((item.lineno, f"overrides the facade's private {item.name}"))
        self.generic_visit(node)
        self.classes.pop()

    def _check(self, line: int, target: ast.AST, attr: str) -> None:
        if not _is_private(attr) or attr in OVERRIDE_POINTS:
            return
        own = isinstance(target, ast.Name) and target.id in ("self", "cls")
        via_super = isinstance(target, ast.Call) and getattr(target.func, "id", None) == "super"
        if own or via_super:
            if self._in_facade_subclass() and attr in self.private:
                self.found.append((line, f"{ast.unparse(target)}.{attr}"))
            return
        if attr in self.private or _names_facade(target):
            self.found.append((line, f"{ast.unparse(target)}.{attr}"))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._check(node.lineno, node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                self._check(node.lineno, node.args[0], name.value)
        self.generic_visit(node)


def private_facade_accesses(source: str, private: set[str], facade_classes: set[str]) -> list[tuple[int, str]]:
    checker = _Checker(private, facade_classes)
    checker.visit(ast.parse(source))
    return checker.found


def _facade_subclasses(path: Path) -> set[str]:
    """The classes of the module that are part of a facade: its subclasses and the mixins it is built from."""
    module = importlib.import_module(_module_name(path))
    return {
        name
        for name, value in vars(module).items()
        if inspect.isclass(value)
        and value.__module__ == module.__name__
        and (issubclass(value, Trainer) or (value is not object and value in Trainer.__mro__))
    }


def test_no_module_but_the_facade_touches_its_private_state():
    private = facade_private_names()
    offences = []
    for path in _source_files():
        if path == FACADE_FILE:
            continue
        found = private_facade_accesses(path.read_text(), private, _facade_subclasses(path))
        offences += [f"{path.relative_to(SRC.parent)}:{line}: {text}" for line, text in found]
    assert offences == [], "private facade state used outside trainer.py:\n" + "\n".join(offences)


def test_the_checker_finds_what_it_must():
    source = """
class Piece:
    def __init__(self, facade):
        self._own = 1                      # its own attribute: fine
        self.facade = facade
    def run(self, trainer, run):
        self.facade._plan                   # flagged: a facade name
        trainer._world()                    # flagged: a private facade name
        run.facade._anything                # flagged: reads through run.facade
        getattr(trainer, "_resume")         # flagged
        trainer._save_checkpoint(None, None) # an override point: fine
        return self._own

class Sub(Trainer):
    def evaluate(self):
        self._world()                        # flagged: facade-private read from a subclass
        super()._backend()                   # flagged
        self._mine = 1                       # the subclass's own name: fine
        return self._get_eval_sampler(None)  # an override point: fine
    def _collator(self, training):           # flagged: overrides a private facade method
        return None
"""
    found = private_facade_accesses(source, {"_world", "_backend", "_collator", "_resume"}, {"Sub"})
    texts = [text for _, text in found]
    assert texts == [
        "self.facade._plan",
        "trainer._world",
        "run.facade._anything",
        "trainer._resume",
        "overrides the facade's private _collator",
        "self._world",
        "super()._backend",
    ]


def test_override_points_are_transformers_protected_methods_on_the_facade():
    for name in OVERRIDE_POINTS:
        assert callable(getattr(transformers.Trainer, name, None)), f"{name} is not a transformers.Trainer method"
        assert callable(getattr(Trainer, name, None)), f"hflight.Trainer lacks the override point {name}"
        ours, theirs = inspect.signature(getattr(Trainer, name)), inspect.signature(getattr(transformers.Trainer, name))
        assert list(ours.parameters) == list(theirs.parameters), f"{name}: {ours} != transformers' {theirs}"


# ---- imports: a DAG in layers ------------------------------------------------------------------------------------
def import_graph() -> dict[str, set[str]]:
    """Module -> the hflight modules it imports (every import statement, type-only and local ones included)."""
    files = {_module_name(p): p for p in _source_files()}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            edges |= {t for t in map(resolve, (t for t in targets if t.startswith("hflight"))) if t and t != module}
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_is_a_dag():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


LIGHTNING_PIECES = (
    "hflight.run.module",
    "hflight.run.datamodule",
    "hflight.run.events",
    "hflight.run.evaluation",
    "hflight.checkpoints.folders",
    "hflight.checkpoints.manifest",
    "hflight.checkpoints.resume",
    "hflight.checkpoints.optim_state",
    "hflight.checkpoints.weights",
    "hflight.checkpoints.writelock",
    "hflight.trainer.steps",
    "hflight.run.plan",
    "hflight.run.distributed",
    "hflight.trainer.hpsearch",
    "hflight.trainer.optim",
    "hflight.arguments.lightning_kwargs",
)
BACKENDS = ("hflight.run.backend", "hflight.ipu.strategy", "hflight.ipu.accelerator", "hflight.ipu.precision",
            "hflight.ort.strategy", "hflight.ort.session")  # fmt: skip


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("module", LIGHTNING_PIECES + BACKENDS)
def test_layers_pieces_and_backends_never_reach_up_to_the_run_or_the_facade(module):
    graph = import_graph()
    above = {"hflight.trainer", "hflight.run.run"}
    if module in BACKENDS:
        above |= {"hflight.run.module", "hflight.run.events"}
    assert not (_reachable(graph, module) & above), f"{module} reaches {sorted(_reachable(graph, module) & above)}"


# ---- sizes -------------------------------------------------------------------------------------------------------
def test_the_facade_stays_small():
    assert len(FACADE_FILE.read_text().splitlines()) <= 400


def test_no_function_is_longer_than_60_lines():
    long = []
    for path in _source_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long.append(f"{path.relative_to(SRC.parent)}:{node.lineno} {node.name} ({length} lines)")
    assert long == [], "functions over 60 lines:\n" + "\n".join(long)
