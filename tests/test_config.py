"""The Hydra config tree: every config composes, every `_target_` binds to its target, mistakes fail early."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from hflight import TrainingArguments
from hflight.config import (
    CONFIG_DIR_ENV,
    VERSION_BASE,
    DataTrainingArguments,
    ModelArguments,
    SFTDataArguments,
    compose,
    find_config_dir,
)

CONF = find_config_dir()
# Groups whose options are composed one by one below; trainer and logger options only write args keys and have
# their own table tests.
GROUPS = ("args", "model", "data", "task", "callbacks", "paths")
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
HPARAMS_SEARCHES = sorted(p.stem for p in (CONF / "hparams_search").glob("*.yaml"))
# Keys of an instantiable node that are instructions to Hydra, not arguments of the target.
HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture(scope="module")
def default_args() -> dict:
    return OmegaConf.to_container(compose([]).args)


def _all_overrides() -> list[list[str]]:
    cases = [[]]
    cases += [[f"+experiment={name}"] for name in EXPERIMENTS]
    cases += [["+experiment=mrc", f"+hparams_search={name}"] for name in HPARAMS_SEARCHES]
    cases += [[f"{group}={option}"] for group in GROUPS for option in _options(group)]
    return cases


def _raw_compose(overrides: list[str]) -> DictConfig:
    """Hydra's own compose, with the hydra node (sweeper and sampler nodes included)."""
    with initialize_config_dir(config_dir=str(CONF), version_base=VERSION_BASE):
        return hydra_compose("train", overrides=overrides, return_hydra_config=True)


def _target_nodes(node: Any, path: str = "") -> list[tuple[str, DictConfig]]:
    found: list[tuple[str, DictConfig]] = []
    if isinstance(node, (DictConfig, ListConfig)) and (
        node._is_none() or node._is_missing() or node._is_interpolation()
    ):
        return found
    if isinstance(node, DictConfig):
        if "_target_" in node:
            found.append((path, node))
        for key in node.keys():
            found += _target_nodes(node._get_node(key), f"{path}.{key}" if path else str(key))
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            found += _target_nodes(item, f"{path}[{i}]")
    return found


def test_the_tree_has_what_the_issue_lists():
    assert {"mrc", "mrc_squad"} <= set(EXPERIMENTS)
    assert "mrc_optuna" in HPARAMS_SEARCHES
    assert {"default", "cpu", "gpu", "ddp"} <= set(_options("trainer"))
    assert {"csv", "tensorboard", "mlflow", "wandb", "none"} <= set(_options("logger"))
    defaults = OmegaConf.load(CONF / "train.yaml").defaults
    listed = {next(iter(d)) if isinstance(d, DictConfig) else d for d in defaults}
    assert {"args", "model", "data", "trainer", "callbacks", "logger", "paths", "hydra"} <= listed
    assert "experiment" not in listed, "experiment must be added with +experiment=..., not listed as a default"


def _bind(path: str, node: DictConfig) -> None:
    target = get_object(node._target_)
    kwargs = {k: v for k, v in node.items_ex(resolve=False) if k not in HYDRA_KEYS}
    signature = inspect.signature(target)
    bind = signature.bind_partial if node.get("_partial_", False) else signature.bind
    try:
        bind(*node.get("_args_", []), **kwargs)
    except TypeError as err:
        pytest.fail(f"{path}: {node._target_} does not accept {sorted(kwargs)}: {err}")


@pytest.mark.parametrize("overrides", _all_overrides(), ids=lambda o: " ".join(o) or "train")
def test_every_config_composes_and_every_target_binds(overrides, tmp_path):
    """Each config builds valid arguments, and (torchtune-style) each `_target_` is resolved and the node's keys
    are bound to its signature, building nothing; `_partial_` nodes may leave arguments to the caller."""
    cfg = compose(overrides, output_dir=tmp_path)
    args = TrainingArguments.from_config(cfg.args)  # runs TrainingArguments.__post_init__: choices, combinations
    assert isinstance(args, TrainingArguments)
    assert args.output_dir == str(tmp_path)
    assert isinstance(OmegaConf.to_object(cfg.model), ModelArguments)
    assert isinstance(OmegaConf.to_object(cfg.data), (DataTrainingArguments, SFTDataArguments))
    assert cfg.optimized_metric
    nodes = _target_nodes(cfg)
    if any(o.startswith("+hparams_search=") for o in overrides):  # the sweeper and its sampler live under hydra
        nodes += [(p, n) for p, n in _target_nodes(_raw_compose(overrides)) if p.startswith("hydra.sweeper")]
        assert any(p == "hydra.sweeper.sampler" for p, _ in nodes)
    assert {"task"} <= {p for p, _ in nodes}
    for path, node in nodes:
        _bind(path, node)


def test_mrc_experiment_targets_what_the_recipe_needs():
    cfg = compose(["+experiment=mrc"])
    assert cfg.task._target_ == "hflight.qa.recipe.MRCRecipe"
    assert cfg.task.trainer._target_ == "hflight.qa.trainer.MRCTrainer" and cfg.task.trainer._partial_
    assert cfg.data.synthetic._target_ == "hflight.qa.synthetic.write_squad_files"
    assert cfg.model.tokenizer_trainer._target_ == "hflight.qa.tokenizer.train_wordpiece_tokenizer"
    assert cfg.model.model_name_or_path is None and cfg.data.train_file is None
    args = TrainingArguments.from_config(cfg.args)
    assert args.eval_strategy.value == "epoch" and args.do_train and args.do_eval
    assert cfg.task.version_2_with_negative is False
    v2 = compose(["+experiment=mrc", "data.version_2_with_negative=true"])
    assert v2.task.version_2_with_negative is True and v2.data.synthetic.version_2_with_negative is True


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("default", dict(accelerator="auto", devices="auto", strategy="auto", num_nodes=1)),
        ("cpu", dict(accelerator="cpu", devices=1, strategy="auto")),
        ("gpu", dict(accelerator="gpu", devices=1)),
        ("gpu_bf16", dict(accelerator="gpu", devices=1, bf16=True)),
        ("ddp", dict(accelerator="gpu", strategy="ddp")),
        ("ddp_cpu", dict(accelerator="cpu", devices=2, strategy="ddp")),
        ("mps", dict(accelerator="mps", devices=1)),
        ("ipu", dict(accelerator="ipu", strategy="ipu")),
        ("ort", dict(accelerator="auto", strategy="ort")),
        ("slurm", dict(accelerator="auto", devices=1, strategy="ddp", num_nodes=1)),  # srun's: tests/test_slurm.py
    ],
)
def test_trainer_options_only_set_hardware_in_args(option, expected, default_args):
    """Every trainer option (the table covers them all) builds valid TrainingArguments that differ from the
    defaults in hardware keys only."""
    base = default_args
    cfg = compose([f"trainer={option}"])
    args = TrainingArguments.from_config(cfg.args)
    for key, value in expected.items():
        assert getattr(args, key) == value, key
    assert "trainer" not in cfg, "trainer writes into args: one source of truth"
    changed = {k for k, v in OmegaConf.to_container(cfg.args).items() if base[k] != v}
    assert changed <= {"accelerator", "devices", "strategy", "num_nodes", "bf16", "fp16"}


def test_the_readme_lists_every_option_schema_and_extra():
    """The README's Configs table names every option of every group (as ``--help`` lists them: the tree's folders
    and the schemas), in its group's row; its Extras list names every extra of pyproject.toml."""
    import re

    from hflight.config import SCHEMAS

    readme = (CONF.parent / "README.md").read_text(encoding="utf-8")
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \|(.*)$", readme, re.MULTILINE)}
    groups = {p.name: _options(p.name) for p in CONF.iterdir() if p.is_dir() and p.name not in ("hydra", "__pycache__")}
    groups["schema"] = sorted(SCHEMAS)
    unlisted = {group: [o for o in options if f"`{o}`" not in rows.get(group, "") and options != ["default"]]
                for group, options in groups.items()}  # fmt: skip
    assert {group: options for group, options in unlisted.items() if options} == {}
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((CONF.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    listed = next(line for line in readme.split("\n\n") if line.startswith("- **Extras**"))
    assert [name for name in extras["optional-dependencies"] if f"`hflight[{name}]`" not in listed] == []


def test_trainer_and_logger_tables_cover_every_option():
    source = Path(__file__).read_text()
    for group in ("trainer", "logger"):
        for option in _options(group):
            assert f'("{option}", ' in source, f"{group}={option} has no row in its table test"


@pytest.mark.parametrize(
    ("option", "report_to"),
    [("csv", ["csv"]), ("tensorboard", ["tensorboard"]), ("mlflow", ["mlflow"]), ("wandb", ["wandb"]), ("none", [])],
)
def test_logger_options_select_report_to(option, report_to):
    assert TrainingArguments.from_config(compose([f"logger={option}"]).args).report_to == report_to


def test_hparams_search_preset_maximizes_the_optimized_metric():
    cfg = _raw_compose(["+experiment=mrc", "+hparams_search=mrc_optuna"])
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_ == "hydra_plugins.hflight_optuna_sweeper.optuna_sweeper.OptunaSweeper"  # hflight's own
    assert sweeper.storage is None and sweeper.pruner is None  # <sweep folder>/optuna.db; no pruning
    assert sweeper.direction == "maximize" and cfg.optimized_metric == "eval_f1"
    assert "args.learning_rate" in sweeper.params
    assert cfg.hydra.mode.name == "MULTIRUN"


# ---- mistakes fail while composing, naming what is wrong -----------------------------------------------------------
@pytest.mark.parametrize("override", ["args.learning_rat=1e-3", "+args.learning_rat=1e-3", "++args.learning_rat=1"])
def test_misspelt_key_fails_naming_it_and_the_closest_fields(override):
    """Hydra advises appending an unknown key with ``+``, which TrainingArguments then refused as a bare TypeError
    (``__init__() got an unexpected keyword argument``): each form names the key and the fields it is closest to."""
    said = "args.learning_rat is not a field of TrainingArguments: did you mean learning_rate?"
    with pytest.raises(ValueError, match=said):
        compose(["+experiment=mrc", override])


@pytest.mark.parametrize("override", ["data.max_seq_lenght=128", "model.model_name=x", "paths.out=x"])
def test_misspelt_key_in_other_groups_fails(override):
    with pytest.raises(ConfigCompositionException, match=override.split("=")[0].replace(".", r"\.")):
        compose([override])


def test_misspelt_group_option_fails_listing_the_choices():
    with pytest.raises(MissingConfigException) as err:
        compose(["trainer=gpux"])
    message = str(err.value)
    assert "gpux" in message and "Available options" in message
    assert all(option in message for option in ("cpu", "gpu", "ddp"))


def test_misspelt_experiment_fails_listing_the_choices():
    with pytest.raises(MissingConfigException, match="mrc_squad"):
        compose(["+experiment=mcr"])


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("args.learning_rate=fast", "args.learning_rate"),
        ("args.num_train_epochs=[1,2]", "args.num_train_epochs"),
        ("data.max_seq_length=long", "data.max_seq_length"),
        ("model.trust_remote_code=maybe", "model.trust_remote_code"),
    ],
)
def test_wrong_type_fails_while_composing(override, key):
    with pytest.raises(ConfigCompositionException) as err:
        compose(["+experiment=mrc", override])
    assert key in str(err.value) + str(err.value.__cause__)


def test_invalid_choice_fails_before_anything_is_built(tmp_path):
    from hflight import cli

    cfg = compose(["+experiment=mrc", "args.optim=adam_fast"], output_dir=tmp_path)
    with pytest.raises(ValueError, match="adamw_torch"):  # the message lists the valid choices
        cli.train(cfg)
    assert not (tmp_path / "data").exists() and not (tmp_path / "tokenizer").exists()


def test_composed_config_is_in_struct_mode():
    cfg = compose(["+experiment=mrc"])
    with pytest.raises((ConfigAttributeError, ConfigKeyError)):
        cfg.args.learnin_rate = 1.0


# ---- where the tree is found ---------------------------------------------------------------------------------------
def test_config_dir_of_the_checkout_and_overrides(tmp_path, monkeypatch):
    assert find_config_dir() == Path(__file__).resolve().parents[1] / "conf"
    monkeypatch.setenv(CONFIG_DIR_ENV, str(CONF))
    assert find_config_dir() == CONF
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=CONFIG_DIR_ENV):
        find_config_dir()
    assert find_config_dir(CONF) == CONF


def test_compose_gives_a_self_contained_config(tmp_path):
    first = compose(["+experiment=mrc"], output_dir=tmp_path / "a")
    second = compose(["+experiment=mrc"], output_dir=tmp_path / "b")
    assert "hydra" not in first
    assert first.args.output_dir == str(tmp_path / "a")  # unaffected by the second compose
    assert second.model.tokenizer_trainer.output_dir == str(tmp_path / "b" / "tokenizer")
    default = compose([])
    assert Path(default.paths.output_dir).parent == Path(default.paths.log_dir).resolve() / "train" / "runs"


# ---- where runs go -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [["+experiment=mrc"], ["+experiment=mrc", "+hparams_search=mrc_optuna"]])
def test_sweep_folder_resolves_where_hydra_resolves_it(tmp_path, monkeypatch, overrides):
    """Hydra's launcher and the Optuna sweeper read hydra.sweep.dir outside of any job, before Hydra's runtime
    config is set: the folders may depend on nothing that only a job has (``${hydra:runtime.cwd}`` did)."""
    from hydra.core.hydra_config import HydraConfig

    monkeypatch.chdir(tmp_path)
    with initialize_config_dir(config_dir=str(CONF), version_base=VERSION_BASE):
        cfg = hydra_compose("train", overrides=overrides, return_hydra_config=True)
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # as in the launcher, before the first job
    sweep = Path(cfg.hydra.sweep.dir)
    assert not sweep.is_absolute() and sweep.parent == Path("outputs/mrc/multiruns")
    monkeypatch.setenv("HFLIGHT_ROOT", str(tmp_path / "elsewhere"))
    assert Path(cfg.hydra.sweep.dir).parent == tmp_path / "elsewhere" / "outputs" / "mrc" / "multiruns"


def test_compose_puts_runs_where_the_command_line_does(tmp_path, monkeypatch):
    """``outputs/<task_name>/runs/<date>_<time>`` below the working directory, or below ``$HFLIGHT_ROOT``."""
    monkeypatch.chdir(tmp_path)
    cfg = compose(["+experiment=mrc"])
    assert Path(cfg.paths.output_dir).parent == tmp_path / "outputs" / "mrc" / "runs"
    assert cfg.args.output_dir == cfg.paths.output_dir == cfg.model.tokenizer_trainer.output_dir[: -len("/tokenizer")]
    monkeypatch.setenv("HFLIGHT_ROOT", str(tmp_path / "root"))
    assert Path(compose([]).paths.output_dir).parent == tmp_path / "root" / "outputs" / "train" / "runs"


def test_model_revision_accepts_both_names():
    from hflight.config import ModelArguments
    from hflight.qa.recipe import hub_kwargs

    assert hub_kwargs(ModelArguments(revision="v2"))["revision"] == "v2"
    assert hub_kwargs(ModelArguments(model_revision="v1"))["revision"] == "v1"
    cfg = compose(["model.revision=abc"])
    assert cfg.model.revision == "abc"
