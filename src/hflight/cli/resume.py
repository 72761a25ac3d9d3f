"""``resume=``: a run (or an Optuna search) continued in its own folder, and ``resume=auto``.

:func:`resume_arguments` turns ``resume=<run folder>`` into that run's own command line (and ``resume=<sweep folder>``
into the search's); :func:`resume_point` decides where a run starts: a checkpoint, the folder's last valid one
(``auto``, also for a process a scheduler restarted), or a fresh start."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from hflight.arguments import cluster
from hflight.arguments.training_args import TrainingArguments
from hflight.checkpoints.manifest import TRAINER_STATE_NAME, get_last_checkpoint
from hflight.checkpoints.storage import storage_for

__all__ = ["AUTO", "OPTUNA_SWEEPER", "RESUME_KEY", "SWEEP_CONFIG", "finished_run", "resume_arguments", "resume_command",
           "resume_point", "resumed_step", "sweep_resume_arguments"]  # fmt: skip

log = logging.getLogger(__name__)

#: The command-line key that continues a run in its own folder.
RESUME_KEY = "resume"
#: ``resume=auto``: continue this run's folder (``hydra.run.dir``) from its last valid checkpoint, or start fresh.
AUTO = "auto"


def _override_key(token: str) -> str | None:
    """The key an override sets (``+experiment=mrc`` -> ``experiment``); None for a flag or its value."""
    if token.startswith("-") or "=" not in token:
        return None
    return token.split("=", 1)[0].lstrip("+~")


def resume_arguments(argv: list[str]) -> list[str]:
    """``argv`` with ``resume=<run folder>`` replaced by that run's own command: its saved overrides
    (``.hydra/overrides.yaml``; an override in ``argv`` replaces the saved one of the same key), its
    ``--config-dir`` (from ``.hydra/hydra.yaml``, unless ``argv`` has one), ``hydra.run.dir=<the folder>`` (the
    same folder again) and ``args.resume_from_checkpoint=true`` (its last valid checkpoint). A job of a sweep
    resumes as one run: its ``+hparams_search=`` preset is dropped (its trial's values are among its overrides) and
    ``hydra.mode=RUN`` added. ``resume=auto`` is ``args.resume_from_checkpoint=auto``: this run's own folder
    (``hydra.run.dir``), continued from its last valid checkpoint or started fresh (:func:`resume_point`). Without
    ``resume=``, ``argv`` unchanged.

    Raises:
        ValueError: ``resume=`` twice, with ``-m``, with ``hydra.run.dir``, naming a path that does not exist or a
            folder that is no run's; ``resume=auto`` with ``args.resume_from_checkpoint``.
    """
    given = [token for token in argv if _override_key(token) == RESUME_KEY]
    if not given:
        return argv
    if len(given) > 1 or given[0].startswith(("+", "~")):
        raise ValueError(
            f"give one run folder as {RESUME_KEY}=<run folder> (or {RESUME_KEY}={AUTO}), got {' '.join(given)}"
        )
    rest = [token for token in argv if token is not given[0]]
    if given[0].split("=", 1)[1] == AUTO:  # this run's own folder: its last valid checkpoint, or a fresh start
        if any(_override_key(token) == "args.resume_from_checkpoint" for token in rest):
            raise ValueError(f"{RESUME_KEY}={AUTO} sets args.resume_from_checkpoint; give one of the two")
        return [*rest, f"args.resume_from_checkpoint={AUTO}"]
    folder = Path(given[0].split("=", 1)[1]).expanduser().resolve()
    if not folder.exists():
        raise ValueError(
            f"{RESUME_KEY}={folder}: no such folder; pass the folder of a run or of a search, e.g. "
            "outputs/mrc/runs/<date>_<time> or outputs/mrc/multiruns/<date>_<time>"
        )
    if (folder / SWEEP_CONFIG).is_file():
        return sweep_resume_arguments(folder, rest)
    if {"-m", "--multirun"} & set(rest):
        raise ValueError(f"{RESUME_KEY}= continues one run; it cannot be combined with -m/--multirun")
    keys = {_override_key(token) for token in rest} - {None}
    if "hydra.run.dir" in keys:
        raise ValueError(f"{RESUME_KEY}= writes into the run folder itself; drop hydra.run.dir")
    saved = _saved_overrides(folder)
    dropped = keys | {"args.resume_from_checkpoint", "hparams_search"}
    kept = [token for token in saved if _override_key(token) not in dropped]
    has_config_dir = any(token.startswith(("--config-dir", "-cd")) for token in rest)
    config_dir = [] if has_config_dir else _saved_config_dirs(folder)
    ending = [f"hydra.run.dir={folder}", "hydra.mode=RUN", "args.resume_from_checkpoint=true"]
    return [*config_dir, *kept, *rest, *ending]


#: What a sweeper writes at the root of a sweep folder: the sweep's composed config, Hydra's part included.
SWEEP_CONFIG = "multirun.yaml"
#: The sweeper whose searches can be continued (their study is in a database).
OPTUNA_SWEEPER = "hydra_plugins.hflight_optuna_sweeper.optuna_sweeper.OptunaSweeper"


def sweep_resume_arguments(folder: Path, rest: list[str]) -> list[str]:
    """``resume=<sweep folder>``: the sweep's own command (its overrides from ``multirun.yaml``, an override in
    ``rest`` replacing the saved one of the same key), ``-m`` and ``hydra.sweep.dir=<the folder>``. The Optuna
    sweeper then reopens the study and runs trials until it holds ``n_trials`` finished ones; job folders number on.

    Raises:
        ValueError: the folder's sweep is not an Optuna search (Hydra's basic sweeper keeps no study to continue)
            or its study was never created.
    """
    import yaml

    saved = yaml.safe_load((folder / SWEEP_CONFIG).read_text(encoding="utf-8")) or {}
    hydra_node = saved.get("hydra") or {}
    target = (hydra_node.get("sweeper") or {}).get("_target_")
    if target != OPTUNA_SWEEPER:
        raise ValueError(
            f"{RESUME_KEY}={folder}: a sweep of {target or 'an unknown sweeper'} keeps no study to continue; only an "
            "Optuna search (+hparams_search=..., hydra/sweeper=optuna) can be continued. Run its unfinished jobs with "
            f"{RESUME_KEY}=<job folder>"
        )
    storage = (hydra_node.get("sweeper") or {}).get("storage")
    if storage is None and not (folder / "optuna.db").is_file():
        raise ValueError(f"{RESUME_KEY}={folder}: the search's study (optuna.db) is not there: it never started")
    overrides = hydra_node.get("overrides") or {}
    keys = {_override_key(token) for token in rest} - {None}
    dropped = keys | {"hydra.sweep.dir", "hydra.mode", RESUME_KEY}
    kept = [t for t in [*overrides.get("task", []), *overrides.get("hydra", [])] if _override_key(t) not in dropped]
    has_config_dir = any(token.startswith(("--config-dir", "-cd")) for token in rest)
    config_dir = [] if has_config_dir else _config_dirs(hydra_node)
    rest = [token for token in rest if token not in ("-m", "--multirun")]
    return ["-m", *config_dir, *kept, *rest, f"hydra.sweep.dir={folder}"]


def _saved_overrides(folder: Path) -> list[str]:
    import yaml

    saved = folder / ".hydra" / "overrides.yaml"
    if not saved.is_file():
        raise ValueError(
            f"{RESUME_KEY}={folder}: neither a run folder (no .hydra/overrides.yaml there) nor a sweep folder (no "
            f"{SWEEP_CONFIG}); pass the folder a run or a search wrote, e.g. outputs/mrc/runs/<date>_<time> or "
            "outputs/mrc/multiruns/<date>_<time>"
        )
    overrides = yaml.safe_load(saved.read_text(encoding="utf-8")) or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ValueError(f"{saved} is not a list of overrides")
    return overrides


def _saved_config_dirs(folder: Path) -> list[str]:
    """``--config-dir DIR`` when the run was started with one (Hydra records it in ``.hydra/hydra.yaml``)."""
    import yaml

    hydra_file = folder / ".hydra" / "hydra.yaml"
    if not hydra_file.is_file():
        return []
    return _config_dirs((yaml.safe_load(hydra_file.read_text(encoding="utf-8")) or {}).get("hydra", {}))


def _config_dirs(hydra_node: dict[str, Any]) -> list[str]:
    runtime = hydra_node.get("runtime") or {}
    for source in runtime.get("config_sources") or []:
        if source.get("provider") == "command-line" and source.get("schema") == "file":
            return ["--config-dir", source["path"]]
    return []


def resume_command(run_dir: str | os.PathLike) -> str:
    """The command that continues the run in ``run_dir`` (printed when a run is interrupted)."""
    return f"hflight-train {RESUME_KEY}={run_dir}"


def _resume_from(value: Any) -> str | bool | None:
    """``args.resume_from_checkpoint`` as ``train()`` takes it: a path, ``true`` (the config's string field holds
    it as "True") for the last valid checkpoint of the output folder, or ``"auto"``: that checkpoint if there is
    one."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return True if value.lower() == "true" else None
    if isinstance(value, str) and value.lower() == AUTO:
        return AUTO
    return value


def resume_point(args: TrainingArguments) -> str | None:
    """``args.resume_from_checkpoint`` as this run will use it. ``resume=auto`` (``args.resume_from_checkpoint=auto``),
    and, when nothing else was asked, a process a scheduler may have restarted (torchrun with ``--max-restarts`` >= 1,
    a requeued SLURM job: ``hflight.arguments.cluster.restart``) continue from the run folder's last valid checkpoint
    (``"auto"``: ``train()`` picks it, checksums included, and skips damaged ones) or, when the folder holds none,
    start fresh, saying so (None)."""
    value = _resume_from(args.resume_from_checkpoint)
    restarted = cluster.restart()
    if value is None and restarted is not None:
        log.warning(
            f"Started by a scheduler that restarts its jobs ({restarted[0]}={restarted[1]}): continuing as "
            f"resume=auto, from the last valid checkpoint of {args.output_dir} if it has one."
        )
        value = AUTO
    if value != AUTO:
        return args.resume_from_checkpoint if value is not None else None
    if storage_for(args).remote:
        return AUTO  # train() lists the store's complete checkpoints (and starts fresh, saying so, if there is none)
    if get_last_checkpoint(args.output_dir) is None:
        log.warning(f"resume=auto: {args.output_dir} holds no complete checkpoint; starting fresh.")
        return None
    return AUTO


def resumed_step(output_dir: str | os.PathLike, resume_from: str | bool | None) -> int:
    """The global step of the checkpoint ``train(resume_from_checkpoint=resume_from)`` starts from (``resume_from``
    as :func:`_resume_from` gives it: True and ``"auto"`` for the last valid checkpoint of ``output_dir``); 0 for a
    fresh start, or a checkpoint whose state cannot be read (``train()`` then says what is wrong with it)."""
    if resume_from is None or resume_from is False:
        return 0
    folder = get_last_checkpoint(output_dir) if resume_from is True or resume_from == AUTO else resume_from
    try:
        return int(json.loads((Path(folder) / TRAINER_STATE_NAME).read_text(encoding="utf-8"))["global_step"])
    except (OSError, TypeError, ValueError, KeyError):
        return 0


def finished_run(output_dir: str | os.PathLike, step: int, max_steps: int, epochs: float) -> str:
    """What a run resumed at ``step`` (of ``max_steps``, ``epochs``), where nothing was left to train, tells."""
    plural = "" if epochs == 1 else "s"
    return (
        f"The run in {output_dir} had already finished: its checkpoint at step {step} is the end of its {max_steps} "
        f"steps ({epochs:g} epoch{plural}), so nothing was trained, and its results (train_results.json, "
        f"all_results.json, eval_results.json, {TRAINER_STATE_NAME}, the model) are kept. To train it further, resume "
        f"it with more steps or epochs: {resume_command(output_dir)} args.max_steps=<more than {step}> (or "
        f"args.num_train_epochs=<more than {epochs:g}>, with args.max_steps unset); args.do_train=false evaluates it "
        "again."
    )
