"""The Hugging Face Hub side of the ``Trainer``: ``init_hf_repo``, ``create_model_card``, ``push_to_hub`` and the
checkpoint pushes ``hub_strategy`` asks for, with transformers' semantics, through ``huggingface_hub``.

As in transformers: with ``args.push_to_hub`` the repository (``hub_model_id``, else the output folder's name) is
created when the trainer is built; every checkpoint save then uploads the model files of the output folder in the
background (and, with ``hub_strategy="checkpoint"``/``"all_checkpoints"``, the checkpoint folder as
``last-checkpoint``/``checkpoint-N``), skipping a save while the previous upload runs unless ``hub_always_push``;
``push_to_hub()`` saves the model, writes the model card (transformers' ``TrainingSummary``) and uploads the output
folder. Only the main process talks to the Hub. The Hub calls go through :func:`hub_api`, a ``huggingface_hub.HfApi``
tagged with hflight's name and version (``HF_ENDPOINT`` and ``HF_TOKEN`` apply as usual).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import CommitInfo, HfApi
from huggingface_hub.repocard import ModelCard
from transformers.modelcard import TrainingSummary
from transformers.trainer_utils import HubStrategy, SaveStrategy
from transformers.utils import PushInProgress

from hflight.checkpoints.parts import part_of
from hflight.checkpoints.weights import TRAINING_ARGS_NAME, is_sharded_run_form
from hflight.checkpoints.writelock import LOCK_NAME
from hflight.run.events import dispatch
from hflight.version import __version__

#: Never uploaded with the output folder: private files, the checkpoint folders and the writer lock.
IGNORED = ["_*", "checkpoint-*", ".tmp-checkpoint-*", LOCK_NAME]

_api: HfApi | None = None


def hub_api() -> HfApi:
    """The shared ``HfApi`` (created on first use, so ``HF_ENDPOINT`` is read when the Hub is first needed)."""
    global _api
    if _api is None:
        _api = HfApi(library_name="hflight", library_version=__version__)
    return _api


def _modeling_files(checkpoint_folder: str) -> list[str]:
    """What a checkpoint push copies from the checkpoint folder into the output folder before uploading it: the
    files of the checkpoint's model part (weights, index and shards, ``config.json``, ``generation_config.json``;
    not a sharded run's own forms, which ``from_pretrained`` does not read)."""
    return sorted(
        name
        for name in os.listdir(checkpoint_folder)
        if part_of(name) == "model" and os.path.isfile(os.path.join(checkpoint_folder, name)) and not
        is_sharded_run_form(name)
    )  # fmt: skip


class HubMixin:
    """transformers' Hub methods of the ``Trainer``, over its public surface (``args``, ``state``, ``model``,
    ``processing_class``, ``callback_handler``, ``save_model``, ``is_world_process_zero``)."""

    hub_model_id: str | None = None
    push_in_progress: PushInProgress | None = None

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Create (or find) the Hub repository ``args.hub_model_id`` (default: the output folder's name)."""
        if not self.is_world_process_zero():
            return
        repo_name = self.args.hub_model_id or Path(self.args.output_dir).absolute().name
        token = token if token is not None else self.args.hub_token
        private = private if private is not None else self.args.hub_private_repo
        self.hub_model_id = hub_api().create_repo(repo_name, token=token, private=private, exist_ok=True).repo_id
        self.push_in_progress = None

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
    ) -> None:
        """Write ``README.md`` in the output folder: transformers' model card draft from the run (hyperparameters,
        evaluation results from ``state.log_history``, framework versions), keeping the tags of an existing card."""
        if not self.is_world_process_zero():
            return
        path = os.path.join(self.args.output_dir, "README.md")
        if os.path.exists(path):
            existing = ModelCard.load(path).data.tags
            if tags is not None and existing is not None:
                tags = [tags] if isinstance(tags, str) else list(tags)
                tags += [tag for tag in existing if tag not in tags]
        summary = TrainingSummary.from_trainer(
            self,
            language=language,
            license=license,
            tags=tags,
            model_name=model_name,
            finetuned_from=finetuned_from,
            tasks=tasks,
            dataset_tags=dataset_tags,
            dataset=dataset,
            dataset_args=dataset_args,
        )
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(summary.to_model_card())

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ) -> CommitInfo:
        """Save the model, write the model card (``kwargs`` go to :meth:`create_model_card`) and upload the output
        folder (without checkpoint folders) to ``hub_model_id``; with ``blocking=False`` a future is returned."""
        dispatch(self, "on_push_begin")
        model_name = kwargs.pop("model_name", None)
        if model_name is None and self.args.should_save:
            model_name = (self.args.hub_model_id or Path(self.args.output_dir).name).split("/")[-1]
        token = token if token is not None else self.args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        model_tags = getattr(self.model, "model_tags", None)
        if model_tags is not None:
            tags = kwargs.get("tags") or []
            tags = [tags] if isinstance(tags, str) else list(tags)
            kwargs["tags"] = tags + [tag for tag in model_tags if tag not in tags]
        self.create_model_card(model_name=model_name, **kwargs)
        self._finish_current_push()
        return hub_api().upload_folder(
            repo_id=self.hub_model_id,
            folder_path=self.args.output_dir,
            commit_message=commit_message,
            token=token,
            run_as_future=not blocking,
            ignore_patterns=IGNORED,
            revision=revision if revision is not None else self.args.hub_revision,
        )

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """After a checkpoint save (the facade's ``_save_checkpoint`` calls it): upload the model files, and with
        ``hub_strategy`` "checkpoint"/"all_checkpoints" the checkpoint folder, in the background."""
        args = self.args
        if not self.is_world_process_zero() or args.hub_strategy == HubStrategy.END:
            return
        if not args.hub_always_push and self.push_in_progress is not None and not self.push_in_progress.is_done():
            return
        dispatch(self, "on_push_begin")
        for name in _modeling_files(checkpoint_folder):
            if os.path.isfile(os.path.join(checkpoint_folder, name)):
                shutil.copy(os.path.join(checkpoint_folder, name), os.path.join(args.output_dir, name))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(args.output_dir)
        torch.save(args.to_transformers(), os.path.join(args.output_dir, TRAINING_ARGS_NAME))
        if args.save_strategy == SaveStrategy.STEPS:
            message = f"Training in progress, step {self.state.global_step}"
        else:
            message = f"Training in progress, epoch {int(self.state.epoch)}"
        upload = dict(repo_id=self.hub_model_id, token=args.hub_token, run_as_future=True, revision=args.hub_revision)
        jobs = [hub_api().upload_folder(folder_path=args.output_dir, commit_message=message, ignore_patterns=IGNORED,
                                        **upload)]  # fmt: skip
        if args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
            in_repo = "last-checkpoint" if args.hub_strategy == HubStrategy.CHECKPOINT else Path(checkpoint_folder).name
            jobs.append(hub_api().upload_folder(folder_path=checkpoint_folder, path_in_repo=in_repo,
                                                commit_message=f"{message}, checkpoint", **upload))  # fmt: skip
        if self.push_in_progress is None or self.push_in_progress.is_done():
            self.push_in_progress = PushInProgress(jobs)
        else:
            self.push_in_progress.jobs.extend(jobs)

    def _finish_current_push(self) -> None:
        """Wait for the checkpoint uploads still running."""
        if self.push_in_progress is not None and not self.push_in_progress.is_done():
            self.push_in_progress.wait_until_done()
