"""The design's rules, checked on the source: the folder tree is the layer picture, collaborators never touch the
facade's private state, one dispatcher fires HF events, and sizes stay small.

- **Layers by package.** Every module of ``hflight`` falls under exactly one rule of :data:`LAYERS` (the longest
  package prefix that matches it; a module under no rule fails), and every ``import`` statement inside ``hflight``
  (type-only and function-level ones included) names a module the rule allows. The graph has no cycle.
- **Private state.** The facade is ``hflight.trainer.facade.Trainer`` and the parts it is assembled from (the classes
  of ``hflight.trainer.*`` in its MRO). Its private names are every single-underscore name a part defines (methods,
  class attributes, ``self._x`` it assigns), except transformers' protected override points listed once in
  ``hflight.surface.OVERRIDE_POINTS``. Outside ``hflight.trainer`` no module reads or writes such a name on anything
  but its own ``self`` (facade subclasses such as ``MRCTrainer`` included, and any name of an expression called
  ``facade``/``trainer``); inside, a part uses only its own private names (only ``facade.py``, the owner, wires them).
- **Events.** HF events reach the callbacks through ``hflight.run.events.dispatch`` only (``qa``, ``ipu``, ``ort`` may
  keep transformers' own pattern where they mirror a class that does so).
- **Sizes.** At most 10 modules directly under ``src/hflight``; every package's ``__init__`` says what the package is
  for and what it may import; ``trainer/facade.py`` has at most 400 lines; no function is longer than 60 lines.
- **The tests.** No test module (``tests/test_*.py``) imports another test module or ``conftest`` (shared helpers live
  in support modules: ``tests/support.py``, ``tests/launch.py``, ``tests/dropin.py``, ...); no test or job spells
  torchrun's path or a fixed port but ``tests/launch.py``, which launches every multi-process job on a free port.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
import transformers

import hflight
from hflight.surface import OVERRIDE_POINTS
from hflight.trainer.facade import Trainer

SRC = Path(hflight.__file__).parent
FACADE_FILE = SRC / "trainer" / "facade.py"
BOTTOM = ("hflight.surface", "hflight._util", "hflight.version", "hflight.durable")

#: module prefix -> the hflight modules it may import (prefixes). The longest matching prefix is a module's rule.
LAYERS: dict[str, tuple[str, ...]] = {
    "hflight.surface": (),
    "hflight._util": (),
    "hflight.durable": (),
    "hflight.version": (),
    "hflight.arguments": ("hflight.arguments", *BOTTOM),
    "hflight.checkpoints": ("hflight.checkpoints", *BOTTOM),
    "hflight.callbacks": ("hflight.callbacks", "hflight.checkpoints", *BOTTOM),
    "hflight.run": ("hflight.run", "hflight.arguments", "hflight.checkpoints", "hflight.callbacks", *BOTTOM),
    "hflight.trainer": (
        "hflight.trainer",
        "hflight.run",
        "hflight.arguments",
        "hflight.checkpoints",
        "hflight.callbacks",
        *BOTTOM,
    ),  # fmt: skip
    # Backends: the Lightning side (accelerators, strategies, precision, sessions) plugs into the run's hooks only.
    "hflight.ipu": ("hflight.ipu", "hflight.run.backend", "hflight.arguments", "hflight.checkpoints", *BOTTOM),
    "hflight.ort": ("hflight.ort", "hflight.run.backend", "hflight.arguments", "hflight.checkpoints", *BOTTOM),
    "hflight.sharding": (
        "hflight.sharding",
        "hflight.run.backend",
        "hflight.arguments",
        "hflight.checkpoints",
        *BOTTOM,
    ),  # fmt: skip
    # ... and the optimum-compatible trainers subclass the facade.
    "hflight.ipu.trainer": (
        "hflight.ipu",
        "hflight.trainer",
        "hflight.run",
        "hflight.arguments",
        "hflight.checkpoints",
        *BOTTOM,
    ),  # fmt: skip
    "hflight.ort.trainer": (
        "hflight.ort",
        "hflight.trainer",
        "hflight.run",
        "hflight.arguments",
        "hflight.callbacks",
        *BOTTOM,
    ),  # fmt: skip
    "hflight.ort.training_args": ("hflight.ort", "hflight.arguments", *BOTTOM),
    "hflight.ort.trainer_seq2seq": ("hflight.ort", "hflight.trainer", "hflight.arguments", *BOTTOM),
    "hflight.ipu.seq2seq": ("hflight.ipu", "hflight.trainer", "hflight.run", "hflight.arguments", *BOTTOM),
    # TRL's trainers on the facade (hflight.trl): the facade, its arguments, the process group accelerate's state uses
    "hflight.trl": ("hflight.trainer", "hflight.arguments", *BOTTOM),
    # The SFT recipe: TRL's SFT on the facade, with the QA recipe's data, checks and run-folder records
    "hflight.sft": ("hflight.sft", "hflight.trl", "hflight.qa", "hflight.arguments", "hflight.config", *BOTTOM),
    "hflight.qa": ("hflight.qa", *BOTTOM),  # data, features, post-processing, metrics: no Lightning, no facade
    "hflight.qa.trainer": ("hflight.qa", "hflight.trainer", "hflight.run", *BOTTOM),
    "hflight.qa.seq2seq_trainer": ("hflight.qa", "hflight.trainer", "hflight.run", *BOTTOM),
    "hflight.qa.recipe": (
        "hflight.qa",
        "hflight.trainer",
        "hflight.arguments",
        "hflight.callbacks",
        "hflight.config",
        *BOTTOM,
    ),  # fmt: skip
    # The top: the package's names, the entry points, and the old import paths kept for users.
    "hflight": ("hflight._util", "hflight.version"),  # __init__: lazy exports only
    "hflight.cli": (
        "hflight.cli",
        "hflight.config",
        "hflight.run.interrupt",
        "hflight.run.console",
        "hflight.arguments",
        "hflight.checkpoints.manifest",
        "hflight.checkpoints.storage",
        "hflight.sweeps.trial",
        "hflight.sweeps.launchers",
        *BOTTOM,
    ),  # fmt: skip
    "hflight.config": ("hflight.arguments", *BOTTOM),
    # sweeps: the Optuna search (hydra_plugins.hflight_optuna_sweeper hands it its config), the job's side of it and
    # any multirun's summary; it reads checkpoints' folders (a retried trial continues the interrupted one) and
    # nothing of the command line above it
    "hflight.sweeps": ("hflight.sweeps", "hflight.checkpoints.manifest", *BOTTOM),
    "hflight.__main__": ("hflight.cli",),
}
TOP_LEVEL_LIMIT = 10
ROOT = "hflight"  # its rule covers the package's ``__init__`` only: a new top-level module needs a rule of its own


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _source_files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py"))


# ---- layers --------------------------------------------------------------------------------------------------------
def import_graph(files: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module -> the hflight modules it imports (every import statement, type-only and local ones included).
    ``files``: module name -> source (default: the package's own)."""
    if files is None:
        files = {_module_name(p): p.read_text() for p in _source_files()}
    packages = {m for m in files if any(other.startswith(m + ".") for other in files)} | {"hflight"}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, source in files.items():
        package = module if module in packages else module.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(source)):
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


def rule_of(module: str, layers: dict[str, tuple[str, ...]] = LAYERS) -> str | None:
    """The longest prefix of ``layers`` that ``module`` falls under (``a.b`` falls under ``a``, but nothing falls
    under :data:`ROOT` but itself), or None."""
    matches = [p for p in layers if module == p or (module.startswith(p + ".") and p != ROOT)]
    return max(matches, key=len) if matches else None


def _allowed(target: str, prefixes: tuple[str, ...]) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def layer_violations(graph: dict[str, set[str]], layers: dict[str, tuple[str, ...]] = LAYERS) -> list[str]:
    found = []
    for module, edges in sorted(graph.items()):
        rule = rule_of(module, layers)
        if rule is None:
            found.append(f"{module}: falls under no layer rule")
            continue
        own = (module,) if rule in ("hflight",) else ()
        found += [
            f"{module} imports {t} (rule {rule!r} allows {', '.join(layers[rule]) or 'nothing of hflight'})"
            for t in sorted(edges)
            if not _allowed(t, layers[rule] + own)
        ]
    return found


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


def test_every_module_falls_under_a_layer_rule_and_imports_only_what_it_allows():
    assert layer_violations(import_graph()) == []


def test_the_import_graph_is_a_dag():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_layer_checker_finds_what_it_must():
    files = {
        "hflight": "",
        "hflight.surface": "",
        "hflight.run": "",
        "hflight.run.loop": "from hflight.surface import X\nfrom hflight import trainer",  # upward: flagged
        "hflight.run.module": "def f():\n    from ..trainer.facade import Trainer",  # relative, local: flagged
        "hflight.trainer": "",
        "hflight.trainer.facade": "from hflight.run import loop",
        "hflight.renamed": "",  # under no rule: flagged
    }
    found = layer_violations(import_graph(files))
    assert found == [
        "hflight.renamed: falls under no layer rule",
        "hflight.run.loop imports hflight.trainer (rule 'hflight.run' allows hflight.run, hflight.arguments, "
        "hflight.checkpoints, hflight.callbacks, hflight.surface, hflight._util, hflight.version, hflight.durable)",
        "hflight.run.module imports hflight.trainer.facade (rule 'hflight.run' allows hflight.run, hflight.arguments, "
        "hflight.checkpoints, hflight.callbacks, hflight.surface, hflight._util, hflight.version, hflight.durable)",
    ]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# ---- the facade's private state ------------------------------------------------------------------------------------
def facade_parts() -> list[type]:
    """The facade and the classes it is assembled from, in ``hflight.trainer``."""
    return [k for k in Trainer.__mro__ if k.__module__.startswith("hflight.trainer.")]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def own_private_names(cls: type) -> set[str]:
    """The private names ``cls`` itself defines: methods and class attributes in its body, and every ``self._x`` its
    methods assign."""
    names = {n for n in vars(cls) if _is_private(n)}
    for node in ast.walk(ast.parse(inspect.getsource(cls))):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "self":
                    if _is_private(target.attr):
                        names.add(target.attr)
    return names - OVERRIDE_POINTS


def facade_private_names() -> dict[str, str]:
    """Private name -> the facade part that owns it."""
    owners: dict[str, str] = {}
    for part in facade_parts():
        for name in own_private_names(part):
            owners.setdefault(name, part.__qualname__)
    return owners


FACADE_NAMES = {"facade", "hf_trainer", "trainer"}


def _names_facade(node: ast.AST) -> bool:
    """``facade``, ``self.facade``, ``self._facade``, ``run.facade``, ``trainer``: an expression naming the facade."""
    if isinstance(node, ast.Name):
        return node.id in FACADE_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr.lstrip("_") in FACADE_NAMES
    return False


class _Checker(ast.NodeVisitor):
    """Collects ``(line, text)`` for every use of a facade-private name that the module may not make.

    ``private``: name -> owning part; ``facade_classes``: the module's classes that are the facade or subclass it
    (they may not use any facade-private name through ``self``); ``parts``: the module's facade parts -> the private
    names each may use through ``self`` (its own)."""

    def __init__(self, private: dict[str, str], facade_classes: set[str], parts: dict[str, set[str]]) -> None:
        self.private = private
        self.facade_classes = facade_classes
        self.parts = parts
        self.classes: list[str] = []
        self.found: list[tuple[int, str]] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        if node.name in self.facade_classes and node.name not in self.parts:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in self.private:
                    self.found.append((item.lineno, f"overrides the facade's private {item.name}"))
        self.generic_visit(node)
        self.classes.pop()

    def _check(self, line: int, target: ast.AST, attr: str) -> None:
        if not _is_private(attr) or attr in OVERRIDE_POINTS:
            return
        cls = self.classes[-1] if self.classes else None
        own = isinstance(target, ast.Name) and target.id in ("self", "cls")
        via_super = isinstance(target, ast.Call) and getattr(target.func, "id", None) == "super"
        if own or via_super:
            if cls in self.parts:
                if attr in self.private and attr not in self.parts[cls]:
                    self.found.append((line, f"{ast.unparse(target)}.{attr} (owned by {self.private[attr]})"))
            elif cls in self.facade_classes and attr in self.private:
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


def private_facade_accesses(
    source: str, private: dict[str, str], facade_classes: set[str], parts: dict[str, set[str]] | None = None
) -> list[tuple[int, str]]:
    checker = _Checker(private, facade_classes, parts or {})
    checker.visit(ast.parse(source))
    return checker.found


def _module_classes(path: Path) -> tuple[set[str], dict[str, set[str]]]:
    """The module's classes that are the facade or subclass it, and its facade parts (-> their own private names)."""
    module = importlib.import_module(_module_name(path))
    classes = [v for v in vars(module).values() if inspect.isclass(v) and v.__module__ == module.__name__]
    parts = {k.__name__: own_private_names(k) for k in classes if k in facade_parts() and k is not Trainer}
    facade = {k.__name__ for k in classes if issubclass(k, Trainer) or k.__name__ in parts}
    return facade, parts


def test_no_module_but_the_facade_touches_its_private_state():
    private = facade_private_names()
    offences = []
    for path in _source_files():
        if path == FACADE_FILE:  # the owner wires its parts
            continue
        facade_classes, parts = _module_classes(path)
        found = private_facade_accesses(path.read_text(), private, facade_classes, parts)
        offences += [f"{path.relative_to(SRC.parent)}:{line}: {text}" for line, text in found]
    assert offences == [], "private facade state used outside its owner:\n" + "\n".join(offences)


def test_the_private_state_checker_finds_what_it_must():
    source = """
class Piece:
    def __init__(self, facade):
        self._own = 1                      # its own attribute: fine
        self.facade = facade
    def run(self, trainer, run, anything):
        self.facade._plan                   # flagged: a facade name
        anything._world()                   # flagged: a facade-private name, whatever the variable
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

class StepsPart:
    def _prepare(self):
        self._steps_cache = 1                # the part's own: fine
        return self._signature_columns       # flagged: another part's private state
"""
    private = {n: "Trainer" for n in ("_world", "_backend", "_collator", "_resume")}
    private.update(_signature_columns="DataLoadersMixin", _steps_cache="StepsPart")
    found = private_facade_accesses(source, private, {"Sub", "StepsPart"}, {"StepsPart": {"_steps_cache"}})
    assert [text for _, text in found] == [
        "self.facade._plan",
        "anything._world",
        "run.facade._anything",
        "trainer._resume",
        "overrides the facade's private _collator",
        "self._world",
        "super()._backend",
        "self._signature_columns (owned by DataLoadersMixin)",
    ]


def test_the_facade_parts_are_found_with_their_private_state():
    names = {k.__name__ for k in facade_parts()}
    assert {"Trainer", "DataLoadersMixin", "StepsMixin", "OptimizerMixin", "HubMixin"} <= names
    private = facade_private_names()
    assert private["_run"] == "Trainer" and private["_signature_columns"] == "DataLoadersMixin"


def test_override_points_are_transformers_protected_methods_on_the_facade():
    for name in OVERRIDE_POINTS:
        assert callable(getattr(transformers.Trainer, name, None)), f"{name} is not a transformers.Trainer method"
        assert callable(getattr(Trainer, name, None)), f"hflight.Trainer lacks the override point {name}"
        ours, theirs = inspect.signature(getattr(Trainer, name)), inspect.signature(getattr(transformers.Trainer, name))
        assert list(ours.parameters) == list(theirs.parameters), f"{name}: {ours} != transformers' {theirs}"


# ---- one dispatcher of HF events -----------------------------------------------------------------------------------
MIRRORS = ("hflight.qa", "hflight.ipu", "hflight.ort")  # may keep transformers'/optimum's own pattern


def event_calls(source: str) -> list[tuple[int, str]]:
    """Calls that fire an HF event other than through ``dispatch``: ``<x>.callback_handler.on_*(...)`` or
    ``getattr(<x>.callback_handler, ...)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr.startswith("on_"):
            holder = func.value
            if isinstance(holder, ast.Attribute) and holder.attr == "callback_handler":
                found.append((node.lineno, ast.unparse(func)))
            elif isinstance(holder, ast.Name) and holder.id in ("handler", "callback_handler"):
                found.append((node.lineno, ast.unparse(func)))
        if isinstance(func, ast.Name) and func.id == "getattr" and node.args:
            if "callback_handler" in ast.unparse(node.args[0]):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_hf_events_are_fired_through_the_one_dispatcher():
    offences = []
    for path in _source_files():
        module = _module_name(path)
        if module == "hflight.run.events" or module.startswith(MIRRORS):
            continue
        offences += [f"{path.relative_to(SRC.parent)}:{line}: {text}" for line, text in event_calls(path.read_text())]
    assert offences == []


def test_the_event_checker_finds_what_it_must():
    source = (
        "trainer.control = trainer.callback_handler.on_log(a, s, c, logs)\n"
        "getattr(self.facade.callback_handler, event)(a, s, c)\n"
        "handler.on_step_end(a, s, c)\n"
        "dispatch(facade, 'on_log', logs)\n"
    )
    assert [line for line, _ in event_calls(source)] == [1, 2, 3]


# ---- sizes, package docstrings, kept import paths ------------------------------------------------------------------
def test_at_most_ten_modules_directly_under_the_package():
    top = sorted(p.name for p in SRC.glob("*.py"))
    assert len(top) <= TOP_LEVEL_LIMIT, top


@pytest.mark.parametrize("package", sorted(p.parent.name for p in SRC.glob("*/__init__.py")))
def test_every_package_says_what_it_is_for_and_what_it_may_import(package):
    doc = ast.get_docstring(ast.parse((SRC / package / "__init__.py").read_text())) or ""
    assert len(doc.split()) >= 15, f"hflight.{package} has no docstring saying what it is for"
    assert "May import" in doc or "may import" in doc, f"hflight.{package}'s docstring does not say what it may import"


@pytest.mark.parametrize(
    "statement",
    [
        "from hflight.trainer import Trainer",
        "from hflight.arguments.training_args import TrainingArguments, config_schema",
        "from hflight import IncompleteCheckpointError, IncompatibleTrainingState, OutputDirInUse, get_last_checkpoint",
        "from hflight import UnsafeCheckpointFile, CheckpointWriteError, IncompleteCheckpointError, verify_checkpoint",
        "from hflight.callbacks import EMACallback",
        "from hflight.ort.trainer import ORTTrainer",
        "from hflight.ort.training_args import ORTTrainingArguments",
        "from hflight.cli import main",
    ],
)
def test_public_import_paths_stay(statement):
    exec(statement, {})


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


def test_the_layout_page_lists_the_override_points_of_the_code():
    """docs/layout.md lists the override points from the code's one list (``hflight.surface.OVERRIDE_POINTS``)."""
    page = (SRC.parents[1] / "docs" / "layout.md").read_text()
    listed = page.split("<!-- override-points -->")[1].split("<!-- /override-points -->")[0]
    assert sorted(name.strip("`, \n") for name in listed.split(",")) == sorted(OVERRIDE_POINTS)


# ---- the tests themselves ----------------------------------------------------------------------------------------
TESTS = Path(__file__).resolve().parent
#: the one module that may spell torchrun's path and choose ports
LAUNCH = "launch.py"
#: torchrun's path spelled out, and a fixed port given to a launcher or a rendezvous (0 is "any free port"; a
#: ``MASTER_PORT`` a unit test sets for a launcher's environment to be read launches nothing)
LAUNCH_SPELLINGS = {
    "torchrun's path": re.compile(r"""with_name\(\s*["']torchrun["']\s*\)"""),
    "a fixed port": re.compile(
        r"""(--master[_-]port|--main[_-]process[_-]port|--rdzv[_-]endpoint)["']?\s*[,= ]?\s*["']?[1-9]\d*\b"""
        r"""|(127\.0\.0\.1|localhost):[1-9]\d{2,4}\b"""
        r"""|(?<![\w."'$:])29[4-9]\d\d(?![\w"'])"""  # a number in torch's customary port range, outside a string
    ),
}


def imported_test_modules(source: str) -> list[str]:
    """The test modules (``test_*``) and ``conftest`` modules that ``source`` imports, relatively or as
    ``tests.<name>``, at the top or inside a function, from this folder or a folder of it (``..qa.conftest``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "tests"):
            path = node.module.split(".") if node.module else []
            package = not path or path[-1] == "tests" or (TESTS / path[-1]).is_dir()  # its names may be modules
            names = [*path, *(alias.name for alias in node.names if package)]
        elif isinstance(node, ast.Import):
            names = [part for alias in node.names if alias.name.startswith("tests.") for part in alias.name.split(".")]
        else:
            continue
        found += [name for name in names if name.startswith("test_") or name == "conftest"]
    return found


def launch_spellings(source: str) -> list[str]:
    """Lines of ``source`` that spell torchrun's path or a fixed port, with what they spell."""
    return [f"{number}: {what}" for number, line in enumerate(source.splitlines(), 1)
            for what, pattern in LAUNCH_SPELLINGS.items() if pattern.search(line)]  # fmt: skip


def test_no_test_module_imports_another_test_module_or_conftest():
    found = [f"{path.relative_to(TESTS)} imports {name}" for path in sorted(TESTS.rglob("test_*.py"))
             for name in imported_test_modules(path.read_text(encoding="utf-8"))]  # fmt: skip
    assert found == [], f"{found}: move shared helpers into a support module (tests/support.py) or a fixture"


def test_only_the_launch_module_spells_torchruns_path_or_a_fixed_port():
    mine = (LAUNCH, Path(__file__).name)  # the launcher, and the checker's own examples below
    files = [p for p in sorted([*TESTS.glob("*.py"), *(TESTS / "jobs").glob("*.py")]) if p.name not in mine]
    found = [f"{path.relative_to(TESTS)}:{line}" for path in files
             for line in launch_spellings(path.read_text(encoding="utf-8"))]  # fmt: skip
    assert found == [], f"{found}: launch multi-process jobs through tests/launch.py (torchrun, free_port)"


def test_the_test_checkers_find_what_they_must():
    source = (
        "from . import dropin, test_cli\nfrom .test_checkpoint import make_trainer\nfrom .conftest import Factory\n"
        "import tests.test_x\nfrom tests.conftest import Factory\nfrom tests import test_y\n"
        "def f():\n    from .test_z import Z\nfrom .support import Factory\nfrom . import launch\nimport testsuite\n"
        "from ..qa.conftest import minilm_tokenizer_dir\nfrom ..qa import conftest\nfrom .dropin import test_like\n"
    )
    assert sorted(imported_test_modules(source)) == sorted(
        ["test_cli", "test_checkpoint", "conftest", "test_x", "conftest", "test_y", "test_z", "conftest", "conftest"]
    )
    lines = [
        'TORCHRUN = Path(sys.executable).with_name("torchrun")',
        'command = [torchrun, "--master_port", "29531", job]',
        'command = [torchrun, "--master_port=29541", job]',
        '["--rdzv_endpoint", "29571"]',
        'argv = ["--rdzv-endpoint=127.0.0.1:29400"]',
        '["--main_process_port", "0"]',  # any free port: allowed
        '[DEEPSPEED, "--master_port", str(launch.free_port())]',
        'command.replace("$HEAD_NODE:29400", f"127.0.0.1:{port}")',
        'for port, impl in ((29531, "hf"), (29532, "hl")):',
    ]
    assert launch_spellings("\n".join(lines)) == [
        "1: torchrun's path", "2: a fixed port", "3: a fixed port", "4: a fixed port", "5: a fixed port",
        "9: a fixed port",
    ]  # fmt: skip
