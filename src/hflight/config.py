"""The Hydra config tree of hflight: its schemas, where it lives, and ``compose`` for notebooks and tests.

Three groups have a structured schema, so a misspelt key or a wrongly typed value fails while the config is
composed, before anything is built: ``args`` has the fields of ``hflight.TrainingArguments`` typed for OmegaConf
(:func:`hflight.arguments.training_args.config_schema`; ``TrainingArguments.from_config`` builds the arguments),
``model`` is :class:`ModelArguments` and ``data`` is :class:`DataTrainingArguments` (the field names of HF's
``run_qa.py``). The schemas are registered in Hydra's ``ConfigStore`` as ``schema/args``, ``schema/model`` and
``schema/data`` when this module is imported; each group's YAML starts from its schema
(``defaults: [/schema/args@_here_]``).

Where the tree is found (:func:`find_config_dir`), first match wins:

1. the ``config_dir`` argument;
2. the ``HFLIGHT_CONFIG_DIR`` environment variable;
3. ``conf/`` of the source checkout this package is imported from (``<repo>/src/hflight`` -> ``<repo>/conf``), which
   is where an editable install (``pip install -e .``) finds it, from any working directory: a notebook in
   ``notebooks/`` composes the repository's ``conf/``;
4. the copy installed inside the package, ``hflight.conf`` (setup.py maps ``conf/`` to it), which is what a regular
   install (a wheel, ``pip install .``) has; Hydra reads it through ``pkg://hflight.conf``.

Hydra's ``--config-dir DIR`` adds the user's own configs (``DIR/experiment/mine.yaml`` -> ``+experiment=mine``) in
front of whichever tree was found.

Example:
    >>> from hflight import cli, config  # doctest: +SKIP
    >>> cfg = config.compose(["+experiment=mrc", "args.num_train_epochs=1"])  # doctest: +SKIP
    >>> metrics, objects = cli.train(cfg)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from hflight.arguments.training_args import TrainingArguments, config_schema

__all__ = [
    "CONFIG_DIR_ENV",
    "DataTrainingArguments",
    "ModelArguments",
    "check_args_fields",
    "check_args_overrides",
    "check_command_line",
    "compose",
    "find_config_dir",
    "register_configs",
]

#: Environment variable naming the config directory (takes precedence over the checkout's ``conf/``).
CONFIG_DIR_ENV = "HFLIGHT_CONFIG_DIR"
#: Hydra's version_base for every entry point (train.py, ``hflight-train``, :func:`compose`).
VERSION_BASE = "1.3"
#: The primary config of the tree.
PRIMARY_CONFIG = "train"
#: The tree installed inside the package (setup.py maps ``conf/`` to ``hflight.conf``).
CONFIG_PACKAGE = "hflight.conf"


# Field types are spelt `Optional[...]` so that OmegaConf (which reads them on Python 3.10) understands them.
# ruff: noqa: UP045
@dataclass
class ModelArguments:
    """Which model and tokenizer to train: ``run_qa.py``'s ``ModelArguments`` plus what building locally needs.

    With ``model_name_or_path`` set, config, tokenizer and weights come from ``from_pretrained`` (a hub id or a local
    folder; ``config_name``/``tokenizer_name`` override the first two). Without it the model is built from scratch:
    its config from ``config_name`` (``AutoConfig.from_pretrained``) or else from the ``config`` node (a ``_target_``
    such as ``transformers.BertConfig``; ``vocab_size`` is set to the tokenizer's size), and its tokenizer from
    ``tokenizer_name`` or else trained on the training texts by the ``tokenizer_trainer`` node (a partial
    ``hflight.qa.tokenizer.train_wordpiece_tokenizer``), saved, and loaded back with ``AutoTokenizer``.
    """

    model_name_or_path: Optional[str] = None
    config_name: Optional[str] = None
    tokenizer_name: Optional[str] = None
    cache_dir: Optional[str] = None
    model_revision: str = "main"
    # The name for the same setting; when set it wins over run_qa.py's ``model_revision``.
    revision: Optional[str] = None
    token: Optional[str] = None
    trust_remote_code: bool = False
    config: Optional[Any] = None
    tokenizer_trainer: Optional[Any] = None


@dataclass
class DataTrainingArguments:
    """Which data to train and evaluate on, and how to window it: ``run_qa.py``'s ``DataTrainingArguments``.

    Data comes from ``dataset_name`` (``datasets.load_dataset``), else from ``train_file``/``validation_file``/
    ``test_file`` (SQuAD-format ``.json`` through ``hflight.qa.data.load_squad_json``; ``.jsonl``/``.csv``/
    ``.parquet`` with flat ``id, title, context, question, answers`` columns through ``datasets``), else from the
    ``synthetic`` node (a ``_target_`` such as ``hflight.qa.synthetic.write_squad_files`` returning the train and
    validation file paths). Setting any of the first four ignores ``synthetic``.
    """

    dataset_name: Optional[str] = None
    dataset_config_name: Optional[str] = None
    train_file: Optional[str] = None
    validation_file: Optional[str] = None
    test_file: Optional[str] = None
    overwrite_cache: bool = False
    preprocessing_num_workers: Optional[int] = None
    max_seq_length: int = 384
    pad_to_max_length: bool = True
    max_train_samples: Optional[int] = None
    max_eval_samples: Optional[int] = None
    max_predict_samples: Optional[int] = None
    version_2_with_negative: bool = False
    null_score_diff_threshold: float = 0.0
    doc_stride: int = 128
    n_best_size: int = 20
    max_answer_length: int = 30
    synthetic: Optional[Any] = None

    @property
    def has_real_data(self) -> bool:
        return any((self.dataset_name, self.train_file, self.validation_file, self.test_file))


@dataclass
class SFTDataArguments:
    """What the ``sft`` task (``hflight.sft.recipe``) fine-tunes on: prompt/completion pairs made from SQuAD-format
    ``train_file``/``validation_file``, else from the files the ``synthetic`` node writes (a ``_target_`` such as
    ``hflight.qa.synthetic.write_squad_files`` returning the train and validation paths); ``max_*_samples`` keep the
    first questions of a split."""

    train_file: Optional[str] = None
    validation_file: Optional[str] = None
    max_train_samples: Optional[int] = None
    max_eval_samples: Optional[int] = None
    synthetic: Optional[Any] = None
    #: train on the pairs as a stream (``datasets.IterableDataset``, ``streaming_shards`` shards), whose position a
    #: checkpoint records: ``resume=`` continues it without reading the trained pairs again; needs ``args.max_steps``
    streaming: bool = False
    streaming_shards: int = 8


#: ConfigStore name -> schema; referenced from the group YAMLs as ``/schema/<name>@_here_``.
SCHEMAS: dict[str, type] = {
    "args": config_schema(TrainingArguments),
    "model": ModelArguments,
    "data": DataTrainingArguments,
    "sft_data": SFTDataArguments,
}


def register_configs() -> None:
    """Store the schemas in Hydra's ``ConfigStore`` (idempotent; runs on import of this module)."""
    store = ConfigStore.instance()
    for name, schema in SCHEMAS.items():
        store.store(group="schema", name=name, node=schema)


#: the module of hflight's Optuna sweeper class, as Hydra names it (``hydra.sweeper._target_``)
SWEEPER_MODULE = "hydra_plugins.hflight_optuna_sweeper.optuna_sweeper"


def expose_sweeper_plugin() -> None:
    """Make hflight's Optuna sweeper (``hydra_plugins.hflight_optuna_sweeper``, beside this package) known to Hydra
    in an editable install too: setuptools' editable finder serves the namespace package to imports but not to
    ``pkgutil``'s listing, which Hydra's plugin scan uses (idempotent; runs on import of this module)."""
    try:
        import hydra_plugins
    except ImportError:
        return
    folder = Path(__file__).resolve().parents[1] / "hydra_plugins"
    if (folder / "hflight_optuna_sweeper").is_dir() and str(folder) not in list(hydra_plugins.__path__):
        hydra_plugins.__path__.append(str(folder))
    # and registered now (its configs, its class) in case Hydra's scan already ran without it: the scan happens once
    # per process, at the first Plugins.instance(), possibly before this module was imported. Only then: the scan
    # executes every module it finds anew, so a class imported here and one the scan found are two classes of one
    # name, and Hydra would list the sweeper twice.
    from hydra.core.plugins import Plugins
    from hydra.plugins.sweeper import Sweeper

    plugins = Plugins.instance()
    name = f"{SWEEPER_MODULE}.OptunaSweeper"
    if not any(f"{known.__module__}.{known.__name__}" == name for known in plugins.discover(Sweeper)):
        plugins.register(importlib.import_module(SWEEPER_MODULE).OptunaSweeper)


def find_config_dir(directory: str | os.PathLike | None = None) -> Path:
    """The config tree's directory (see the module docstring for the search order).

    Raises:
        FileNotFoundError: the directory found has no ``train.yaml``; the message lists what was tried.
    """
    tried: list[str] = []
    candidates = [
        ("argument", directory),
        (f"${CONFIG_DIR_ENV}", os.environ.get(CONFIG_DIR_ENV)),
        ("source checkout", Path(__file__).resolve().parents[2] / "conf"),
        ("installed package", _installed_tree()),
    ]
    for origin, candidate in candidates:
        if not candidate:
            continue
        path = Path(candidate).expanduser().resolve()
        if (path / f"{PRIMARY_CONFIG}.yaml").is_file():
            return path
        tried.append(f"{path} ({origin})")
        if origin not in ("source checkout", "installed package"):  # an explicit choice that is wrong is an error
            break
    raise FileNotFoundError(
        f"hflight's Hydra config tree ({PRIMARY_CONFIG}.yaml) was not found in: {', '.join(tried)}. Pass "
        f"config_dir=..., set {CONFIG_DIR_ENV}, or reinstall hflight (its wheel ships the tree as {CONFIG_PACKAGE})."
    )


def _installed_tree() -> str | None:
    """The folder of the installed ``hflight.conf`` package, if there is one on the file system."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(CONFIG_PACKAGE)
    except ImportError:
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return locations[0] if locations else None


def hydra_config_path() -> str:
    """``config_path`` for ``@hydra.main``: the folder :func:`find_config_dir` finds, else Hydra's
    ``pkg://hflight.conf`` (an install whose package is not a plain folder, e.g. a zip)."""
    try:
        return str(find_config_dir())
    except FileNotFoundError:
        if os.environ.get(CONFIG_DIR_ENV):
            raise
        return f"pkg://{CONFIG_PACKAGE}"


def check_args_fields(names: Iterable[str]) -> None:
    """Each of ``names`` (keys under ``args``) is a field of ``TrainingArguments``.

    Raises:
        ValueError: naming each key that is not, with the closest fields ("did you mean learning_rate?").
    """
    fields = sorted(f.name for f in dataclasses.fields(TrainingArguments) if f.init)
    unknown = [name for name in names if name not in fields]
    if not unknown:
        return
    said = []
    for name in unknown:
        close = difflib.get_close_matches(name, fields, n=3, cutoff=0.6)
        guess = f": did you mean {' or '.join(close)}?" if close else ""
        said.append(f"args.{name} is not a field of TrainingArguments{guess}")
    raise ValueError("; ".join(said) + " (args holds its fields under transformers' names; --cfg job prints them)")


def check_args_overrides(overrides: Iterable[str]) -> None:
    """The keys under ``args`` that command-line overrides set, add or delete (``args.NAME=...``, ``+args.NAME=...``,
    ``++args.NAME=...``, ``~args.NAME``) are fields of ``TrainingArguments``: checked before Hydra composes the config,
    which would advise adding an unknown one with ``+`` (then refused by ``TrainingArguments`` without its name).

    Raises:
        ValueError: see :func:`check_args_fields`.
    """
    keys = [token.split("=", 1)[0].lstrip("+~") for token in overrides if not token.startswith("-")]
    check_args_fields([key.split(".")[1] for key in keys if key.startswith("args.")])


def check_command_line(overrides: Iterable[str], config_dir: str | os.PathLike | None = None) -> None:
    """:func:`check_args_overrides`, and two slips Hydra's command line answers with its generic errors: a field of
    ``TrainingArguments`` given without ``args.`` (``learning_rate=1e-4``: "did you mean args.learning_rate?"), and
    an option a config group does not have (``+experiment=mcr``: "did you mean mrc?"). A group's options are the ones
    Hydra itself would find: the config tree, ``--config-dir`` folders, the primary config's ``hydra.searchpath`` and
    plugins' configs (``hydra/launcher=joblib``).

    Raises:
        ValueError: naming the slip and what was meant.
    """
    overrides = list(overrides)
    check_args_overrides(overrides)
    tokens = [token for token in overrides if not token.startswith("-") and "=" in token]
    try:
        directory = find_config_dir(config_dir)
    except FileNotFoundError:
        return
    fields = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    named = {argument.split("=", 1)[0] for argument in overrides if argument.startswith("-")}
    tree_of_its_own = bool(named & set(_TREE_OPTIONS))
    suspects = [token for token in tokens if not token.startswith(("+", "~")) and "." not in token.split("=", 1)[0]
                and token.split("=", 1)[0] in fields]  # fmt: skip
    if suspects and not tree_of_its_own and not named & {"--config-dir", "-cd"}:
        # a field without args.: unless the config composed from the other overrides has such a key
        keys = _composed_keys([token for token in tokens if token not in suspects], directory)
        for token in suspects:
            key, value = token.split("=", 1)
            if keys is not None and key not in keys:
                raise ValueError(f"{key} is not a key of the config: did you mean args.{key}={value}? "
                                 "(TrainingArguments' fields are under args)")  # fmt: skip
    if tree_of_its_own or any(token.split("=", 1)[0].lstrip("+~") == "hydra.searchpath" for token in tokens):
        return  # another primary config, or folders added by an override: Hydra's own error is the reliable one
    options = _group_options(directory, _config_dir_arguments(overrides))
    if options is None:
        return
    for token in tokens:
        key, value = token.split("=", 1)
        _check_group_option(options, key.lstrip("+~"), value)


#: Hydra's options that name another primary config (its own keys, its own search path)
_TREE_OPTIONS = ("--config-name", "-cn", "--config-path", "-cp")


def _composed_keys(overrides: Sequence[str], directory: Path) -> set[str] | None:
    """The top-level keys of the config composed from ``overrides`` (a ``_global_`` experiment may add some), or
    ``None`` when it does not compose (Hydra then says why)."""
    keys = _top_level_keys(directory)
    try:
        with initialize_config_dir(config_dir=str(directory), version_base=VERSION_BASE, job_name=PRIMARY_CONFIG):
            cfg = hydra_compose(config_name=PRIMARY_CONFIG, overrides=list(overrides))
    except Exception:  # noqa: BLE001 - a check before Hydra; Hydra reports whatever stops it here
        return None
    return keys | set(cfg.keys())


def _config_dir_arguments(arguments: Sequence[str]) -> list[str]:
    """The folders named by ``--config-dir``/``-cd`` (``--config-dir X`` or ``--config-dir=X``)."""
    found = []
    for index, argument in enumerate(arguments):
        name, _, value = argument.partition("=")
        if name in ("--config-dir", "-cd"):
            if value:
                found.append(value)
            elif index + 1 < len(arguments):
                found.append(arguments[index + 1])
    return found


def _group_options(directory: Path, extra: Sequence[str]) -> Callable[[str], list[str] | None] | None:
    """A function giving a config group's options as Hydra finds them (``None``: not a group), or ``None`` when
    Hydra's loader cannot be asked (then nothing is checked here and Hydra's own error stands)."""
    try:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra._internal.utils import create_config_search_path
        from hydra.core.object_type import ObjectType

        search_path = create_config_search_path(str(directory))
        for folder in extra:
            search_path.prepend("command-line", f"file://{os.path.abspath(folder)}")
        for folder in [*extra, directory]:  # the primary config's own search path (hydra.searchpath in it)
            primary = Path(folder) / f"{PRIMARY_CONFIG}.yaml"
            if primary.is_file():
                listed = OmegaConf.select(OmegaConf.load(primary), "hydra.searchpath") or []
                for entry in listed:
                    search_path.append("main", str(entry))
        loader = ConfigLoaderImpl(config_search_path=search_path)
    except Exception:  # noqa: BLE001 - a check before Hydra; Hydra reports whatever stops it here
        return None

    def options(group: str) -> list[str] | None:
        try:
            if not loader.repository.group_exists(group):
                return None
            return sorted(loader.get_group_options(group, results_filter=ObjectType.CONFIG))
        except Exception:  # noqa: BLE001
            return None

    return options


def _top_level_keys(directory: Path) -> set[str]:
    """The primary config's own keys and its config groups (the folders of the tree)."""
    from omegaconf import OmegaConf

    keys = {path.name for path in directory.iterdir() if path.is_dir()}
    with contextlib.suppress(Exception):
        keys |= set(OmegaConf.load(directory / f"{PRIMARY_CONFIG}.yaml").keys())
    return keys


def _check_group_option(options: Callable[[str], list[str] | None], group: str, option: str) -> None:
    """``group=option`` names a config of the group, or a ``ValueError`` with the closest."""
    if "." in group or not option or option in ("null", "None") or "," in option or "(" in option:
        return
    known = options(group)
    if not known or option in known or any(name.startswith(f"{option}/") for name in known):
        return
    if options(f"{group}/{option}") is not None:
        return  # a folder of the group
    close = difflib.get_close_matches(option, known, n=2, cutoff=0.5)
    guess = f"; did you mean {' or '.join(close)}?" if close else ""
    raise ValueError(f"{group}={option}: {group} has no option {option!r} (its options: {', '.join(known)}){guess}")


def compose(
    overrides: Sequence[str] = (),
    config_name: str = PRIMARY_CONFIG,
    output_dir: str | os.PathLike | None = None,
    config_dir: str | os.PathLike | None = None,
) -> DictConfig:
    """Compose the config as ``python train.py OVERRIDES`` would, outside of ``@hydra.main``.

    ``compose`` has no run directory of its own, so it sets one up the way ``@hydra.main`` does: ``output_dir`` or
    else ``hydra.run.dir`` (under ``paths.log_dir``) becomes ``paths.output_dir``. The returned config has no
    ``hydra`` node and no ``${hydra:...}`` references left, so several composed configs can live side by side.
    It is in struct mode: a misspelt key fails on assignment as it does on the command line.

    Args:
        overrides: command-line style overrides, e.g. ``["+experiment=mrc", "args.num_train_epochs=1"]``.
        config_name: the primary config.
        output_dir: the run directory (created when training starts); default: ``hydra.run.dir``.
        config_dir: the config tree; default: see :func:`find_config_dir`.

    Raises:
        ValueError: an override names a key under ``args`` that is not a field of ``TrainingArguments``.
        hydra.errors.ConfigCompositionException, hydra.errors.MissingConfigException,
        omegaconf.errors.ValidationError: an unknown key, group option or wrongly typed value.
    """
    check_args_overrides(overrides)
    register_configs()
    directory = find_config_dir(config_dir)
    with initialize_config_dir(config_dir=str(directory), version_base=VERSION_BASE, job_name=config_name):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    # hydra.run.dir is relative to the working directory, made absolute here as Hydra's run_job does
    run_dir = os.path.abspath(output_dir if output_dir is not None else cfg.hydra.run.dir)
    with read_write(cfg.hydra.runtime):
        cfg.hydra.runtime.output_dir = run_dir
    HydraConfig.instance().set_config(cfg)  # resolves ${hydra:runtime.output_dir} (paths.output_dir) below
    with open_dict(cfg):
        if "paths" in cfg:
            cfg.paths = OmegaConf.create(OmegaConf.to_container(cfg.paths, resolve=True))
        del cfg["hydra"]
    return cfg


register_configs()
expose_sweeper_plugin()
# conf/hydra/launcher/submitit_slurm.yaml sets values of the submitit plugin's config of that name on purpose: Hydra
# then validates it against the plugin's schema, and warns that this matching is deprecated.
warnings.filterwarnings(
    "ignore",
    message=r"(?s).*'hydra/launcher/submitit_slurm' is validated against ConfigStore schema",
    category=UserWarning,
)
