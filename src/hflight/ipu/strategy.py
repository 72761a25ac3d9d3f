"""``IPUStrategy``: hflight's HF loop on Graphcore IPUs through poptorch.

One ``poptorch.trainingModel`` runs the fit: each call consumes a combined batch (micro-batch x replication x
device iterations x gradient accumulation) and performs forward, backward, the on-device gradient accumulation and
``device_iterations`` optimizer steps. Evaluation and prediction run ``poptorch.inferenceModel``s that share the host
weights. The host loop keeps transformers' semantics as optimum-graphcore defines them: one host step per combined
batch; after it ``lr_scheduler.step()``, then ``setOptimizer`` (the only way a new learning rate reaches the device),
then ``global_step += 1``; the training executable is detached from the IPUs around every evaluation and attached
again after it; weights are copied to the host before every checkpoint and ``save_model``; executables are destroyed
at teardown.

Gradient accumulation happens on the device only: the facade's ``gradient_accumulation_steps`` becomes the
``IPUConfig``'s and the host loop runs with an accumulation of 1, so nothing is accumulated twice.

Written against poptorch's documented API (SDK 3.x); verified here against a test stand-in of that API, never run
on IPU hardware (the last public poptorch needs torch 2.0.1).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from hflight.checkpoints.names import CONFIG_NAME
from hflight.ipu.config import IPUConfig
from hflight.ipu.data import pad_on_batch_axis
from hflight.ipu.generation import IPUGeneration, check_generation_options
from hflight.ipu.last_batch import ShapedInference
from hflight.ipu.precision import IPUPrecision
from hflight.ipu.runtime import require_poptorch
from hflight.run.backend import HFBackend, StepGeometry

if TYPE_CHECKING:
    import lightning as L

    from hflight.surface import TrainerSurface

log = logging.getLogger(__name__)

# torch optimizer -> (poptorch.optim class name, per-group hyper-parameters it takes, takes max_grad_norm)
_POPTORCH_OPTIMIZERS: dict[type, tuple[str, tuple[str, ...], bool]] = {
    torch.optim.AdamW: ("AdamW", ("lr", "betas", "eps", "weight_decay"), True),
    torch.optim.Adam: ("Adam", ("lr", "betas", "eps", "weight_decay"), True),
    torch.optim.SGD: ("SGD", ("lr", "momentum", "dampening", "weight_decay", "nesterov"), True),
    torch.optim.RMSprop: ("RMSprop", ("lr", "alpha", "eps", "weight_decay", "momentum", "centered"), False),
}
_DATALOADER_MODES = {"sync": "Sync", "async": "Async", "async_rebatched": "AsyncRebatched"}


def as_ipu_config(ipu_config: IPUConfig | dict | str | None) -> IPUConfig:
    """An ``IPUConfig`` (a copy) from a config, a dict, a path/Hub name, or None for the defaults."""
    if ipu_config is None:
        return IPUConfig()
    if isinstance(ipu_config, IPUConfig):
        return copy.deepcopy(ipu_config)
    if isinstance(ipu_config, dict):
        return IPUConfig.from_dict(ipu_config)
    if isinstance(ipu_config, str):
        return IPUConfig.from_pretrained(ipu_config)
    raise TypeError(f"ipu_config must be an IPUConfig, a dict, a path or None, got {type(ipu_config).__name__}")


def _device_only_step(*args: Any, **kwargs: Any) -> None:
    raise MisconfigurationException(
        "This optimizer runs on the IPU: its step happens inside the poptorch training call, not on the host."
    )


# torch's LR schedulers check that optimizer.step was wrapped by them; the device-only step counts as wrapped.
_device_only_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


class IPUStrategy(SingleDeviceStrategy, HFBackend):
    """Training, evaluation and prediction on Graphcore IPUs (``strategy="ipu"``).

    Args:
        ipu_config: an :class:`~hflight.ipu.IPUConfig`, a dict of its fields, a folder/JSON file/Hub name holding
            ``ipu_config.json``, or None for the defaults.
        pad_on_batch_axis: pad the last, incomplete evaluation batch to the combined batch size by repeating rows
            (the compiled executable takes one batch shape); off: a second inference executable is compiled for its
            rows (``hflight.ipu.last_batch``). Either way its outputs are cut back to its real rows. On by default
            here; ``IPUTrainer`` keeps optimum-graphcore's default, off.
        compile_only: compile against an offline IPU target (no hardware needed) and run nothing.
        loss_scaling: the poptorch optimizer's loss scaling (useful in float16).
        dataloader_mode: ``"sync"``, ``"async"`` or ``"async_rebatched"`` (``poptorch.DataLoaderMode``).
    """

    strategy_name = "ipu"
    #: the device averages the loss over its micro-batches; the model must not normalise by host item counts
    hf_counts_loss_items = False

    def __init__(
        self,
        ipu_config: IPUConfig | dict | str | None = None,
        pad_on_batch_axis: bool = True,
        compile_only: bool = False,
        loss_scaling: float | None = None,
        dataloader_mode: str = "sync",
        accelerator: L.pytorch.accelerators.Accelerator | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        self.poptorch = require_poptorch()
        super().__init__(
            device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin
        )
        if dataloader_mode not in _DATALOADER_MODES:
            raise ValueError(f"dataloader_mode must be one of {', '.join(_DATALOADER_MODES)}, got {dataloader_mode!r}")
        self.ipu_config = as_ipu_config(ipu_config)
        self.pad_on_batch_axis = pad_on_batch_axis
        self.compile_only = compile_only
        self.loss_scaling = loss_scaling
        self.dataloader_mode = dataloader_mode
        self.training_model: Any = None
        self.inference_model: Any = None
        self.generation: IPUGeneration | None = None  # the encoder/decoder executables of generation
        self._options: dict[bool, Any] = {}
        self._model_class_name: str | None = None  # the model's own class, which trainingModel replaces

    # ---- precision: Lightning builds a plain plugin from `precision=`; the IPU needs its own -------------------
    @property
    def precision_plugin(self) -> IPUPrecision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else IPUPrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else IPUPrecision.adopt(plugin)

    # ---- options -------------------------------------------------------------------------------------------------
    def options(self, for_inference: bool) -> Any:
        """The ``poptorch.Options`` of the training or the inference executable (built once per run)."""
        if for_inference not in self._options:
            self._options[for_inference] = self.ipu_config.to_options(
                for_inference=for_inference, compile_only=self.compile_only
            )
        return self._options[for_inference]

    def use_host_accumulation(self, gradient_accumulation_steps: int) -> None:
        """Move a host gradient accumulation into the device's (the facade's argument wins over the config)."""
        if gradient_accumulation_steps in (1, self.ipu_config.gradient_accumulation_steps):
            return
        if self.ipu_config.gradient_accumulation_steps != 1:
            log.warning(
                "gradient_accumulation_steps=%d overrides the IPUConfig's %d (accumulation runs on the device).",
                gradient_accumulation_steps,
                self.ipu_config.gradient_accumulation_steps,
            )
        self.ipu_config.gradient_accumulation_steps = gradient_accumulation_steps
        self._options.pop(False, None)

    # ---- HFBackend hooks -------------------------------------------------------------------------------------------
    @override
    def hf_geometry(self, args: Any, world_size: int, batch_size: int) -> StepGeometry:
        self.use_host_accumulation(args.gradient_accumulation_steps)
        return StepGeometry(1, batch_size * self.ipu_config.batch_size_factor())

    @override
    def hf_prepare_loader(self, loader: Any, training: bool) -> Any:
        poptorch = self.poptorch
        if isinstance(loader, poptorch.DataLoader) or not isinstance(loader, DataLoader):
            return loader
        options = self.options(for_inference=not training)
        collate, padded_to = loader.collate_fn, None
        # a training executable takes complete combined batches only; evaluation drops the last, incomplete one where
        # the loader was made to (dataloader_drop_last, as optimum-graphcore's evaluation loader passes it on)
        drop_last = training or bool(loader.drop_last)
        if not drop_last and loader.batch_size is not None:  # an incomplete last batch: its real rows counted
            padded_to = loader.batch_size * self.ipu_config.batch_size_factor(for_inference=True)
            if self.pad_on_batch_axis:  # padded to the executable's shape; else run by one of its own (last_batch)
                collate = pad_on_batch_axis(padded_to)(collate)
        kwargs: dict[str, Any] = {
            "collate_fn": collate,
            "num_workers": loader.num_workers,
            "pin_memory": loader.pin_memory,
            "worker_init_fn": loader.worker_init_fn,
            "drop_last": drop_last,
            "mode": getattr(poptorch.DataLoaderMode, _DATALOADER_MODES[self.dataloader_mode]),
        }
        if loader.num_workers > 0:
            kwargs["persistent_workers"] = loader.persistent_workers
            kwargs["prefetch_factor"] = loader.prefetch_factor
        if loader.batch_size is None:  # the facade's loader used a batch sampler
            kwargs["batch_sampler"] = loader.batch_sampler
            kwargs["auto_distributed_partitioning"] = False
        else:
            kwargs["batch_size"] = loader.batch_size
            if not isinstance(loader.dataset, IterableDataset):
                kwargs["sampler"] = loader.sampler
        made = poptorch.DataLoader(options, loader.dataset, **kwargs)
        if padded_to is not None:  # the real rows of the last batch, which the evaluation keeps of what its call gave
            with contextlib.suppress(TypeError):  # (accelerate's ``remainder``); a dataset without a length: unknown
                made.remainder = len(loader.dataset) % padded_to
        return made

    @override
    def hf_evaluation_rows(self, eval_batch_size: int) -> int:
        # one inference call takes a combined batch (micro-batch x inference replicas x device iterations) and gives
        # one loss for all of its rows; the last, incomplete one (padded, or run by an executable of its own) is then
        # cut to the loader's ``remainder`` of real rows: each call's loss weighs its real rows, as on the CPU
        return eval_batch_size * self.ipu_config.batch_size_factor(for_inference=True)

    @override
    def hf_configure_optimizer(self, facade: TrainerSurface) -> None:
        optimizer = self.to_poptorch_optimizer(facade.optimizer, facade.args.max_grad_norm)
        if optimizer is not facade.optimizer:
            scheduler = facade.lr_scheduler
            if scheduler is not None and getattr(scheduler, "optimizer", None) is facade.optimizer:
                scheduler.optimizer = optimizer
            facade.optimizer = facade.callback_handler.optimizer = optimizer
        model = self.lightning_module.model
        options = self.options(for_inference=False)
        self._model_class_name = type(model).__name__
        self.training_model = self.poptorch.trainingModel(model.train(), options=options, optimizer=optimizer)

    def to_poptorch_optimizer(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> Any:
        """A poptorch optimizer with the same parameter groups and hyper-parameters (HF's ``max_grad_norm`` and the
        precision's accumulation dtypes added); a poptorch optimizer is returned as it is."""
        optim = self.poptorch.optim
        if isinstance(optimizer, optim.Optimizer):
            return optimizer
        spec = _POPTORCH_OPTIMIZERS.get(type(optimizer))
        if spec is None:
            raise MisconfigurationException(
                f"{type(optimizer).__name__} has no poptorch counterpart; on the IPU use AdamW, Adam, SGD, RMSprop "
                "(optim='adamw_torch', 'sgd', 'rmsprop') or poptorch.optim.LAMB."
            )
        name, group_keys, takes_norm = spec
        if optimizer.defaults.get("amsgrad"):
            raise MisconfigurationException("poptorch's Adam/AdamW do not support amsgrad=True.")
        groups = [
            {key: value for key, value in group.items() if key in (*group_keys, "params", "initial_lr")}
            for group in optimizer.param_groups
        ]
        kwargs = {key: optimizer.defaults[key] for key in group_keys if key in optimizer.defaults}
        kwargs["loss_scaling"] = self.loss_scaling
        dtypes = self.precision_plugin.optimizer_dtypes()
        kwargs.update(dtypes if name != "SGD" else {"accum_type": dtypes["accum_type"]})
        if takes_norm and max_grad_norm and max_grad_norm > 0:
            kwargs["max_grad_norm"] = float(max_grad_norm)
        converted = getattr(optim, name)(groups, **kwargs)
        converted.step = _device_only_step
        return converted

    @override
    def hf_training_model(self, model: torch.nn.Module) -> Callable[..., Any]:
        if self.training_model is None:
            raise MisconfigurationException("The IPU training executable is built when the fit's optimizer is.")
        return self.training_model

    @override
    def hf_optimizer_step(self, module: L.LightningModule) -> bool:
        # The device already ran the step inside the training call; no gradients exist on the host.
        optimizer = module.optimizers().optimizer
        optimizer._opt_called = True  # what torch's LR schedulers look for before their first step
        module.pre_optimizer_step(grad_norm=None)
        return True

    @override
    def hf_after_scheduler_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.training_model.setOptimizer(optimizer)  # the new learning rate reaches the device

    @override
    @contextlib.contextmanager
    def hf_evaluation_model(self, model: torch.nn.Module, label_names: list[str]) -> Iterator[Callable[..., Any]]:
        training = self.training_model
        reattach = training is not None and training.isCompiled() and training.isAttachedToDevice()
        if reattach:
            training.detachFromDevice()  # frees the IPUs (and brings the weights to the host)
        if self.inference_model is None:
            make = functools.partial(self.poptorch.inferenceModel, model.eval())
            self.inference_model = ShapedInference(make(options=self.options(True)), lambda options: make(
                options=options), self.options(True), self.ipu_config.inference_replication_factor)  # fmt: skip
        inference = self.inference_model
        if self.generation is not None:
            self.generation.begin()  # the trained weights reach the generation executables at their next call
        try:
            yield inference
        finally:
            for executable in inference.executables():
                if executable.isCompiled() and executable.isAttachedToDevice():
                    executable.detachFromDevice()
            if self.generation is not None:
                self.generation.detach()
            if reattach:
                training.attachToDevice()

    def generation_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` as transformers' ``generate`` sees it, its encoder and decoder steps run on inference
        executables (:mod:`hflight.ipu.generation`); they live until teardown, as the other executables."""
        check_generation_options(self.ipu_config.inference_parallelize_kwargs)
        if self.generation is None:
            factor = self.ipu_config.batch_size_factor(for_inference=True)
            self.generation = IPUGeneration(self.poptorch, lambda: self.options(for_inference=True), factor)
        return self.generation.model_for(model)

    @override
    def hf_sync_to_host(self) -> None:
        training = self.training_model
        if training is not None and training.isCompiled() and training.isAttachedToDevice():
            training.copyWeightsToHost()

    @override
    def hf_save_files(self, output_dir: str) -> None:
        self.ipu_config.save_pretrained(output_dir)
        self._restore_architectures(output_dir)

    def _restore_architectures(self, output_dir: str) -> None:
        """Until its executable is destroyed, ``poptorch.trainingModel`` gives the model a ``Poptorch<Name>``
        subclass, and transformers' ``save_pretrained`` writes that name into ``config.json``; a checkpoint must name
        the model's own class (resuming and ``from_pretrained`` check it)."""
        model = getattr(self.lightning_module, "model", None)
        config = getattr(model, "config", None)
        name = self._model_class_name
        if name is None or getattr(config, "architectures", None) != [f"Poptorch{name}"]:
            return
        config.architectures = [name]
        if os.path.isfile(os.path.join(output_dir, CONFIG_NAME)):
            config.save_pretrained(output_dir)

    # ---- compile_only ------------------------------------------------------------------------------------------------
    def compile_executables(self, facade: TrainerSurface, training: bool, evaluation: bool) -> None:
        """Compile the training and/or inference executables against the first batch, and run nothing."""
        model = self.precision_plugin.convert_module(facade.model)
        if training:
            facade.create_optimizer()
            optimizer = self.to_poptorch_optimizer(facade.optimizer, facade.args.max_grad_norm)
            self.use_host_accumulation(facade.args.gradient_accumulation_steps)
            executable = self.poptorch.trainingModel(model.train(), options=self.options(False), optimizer=optimizer)
            self._compile(executable, self.hf_prepare_loader(facade.get_train_dataloader(), training=True), "training")
            executable.destroy()
        if evaluation:
            executable = self.poptorch.inferenceModel(model.eval(), options=self.options(True))
            self._compile(executable, self.hf_prepare_loader(facade.get_eval_dataloader(), training=False), "inference")
            executable.destroy()

    @staticmethod
    def _compile(executable: Any, loader: Any, kind: str) -> None:
        try:
            batch = next(iter(loader))
        except StopIteration:
            raise ValueError(
                "compile_only: the dataloader yielded no batch (the dataset is smaller than one combined batch)."
            ) from None
        log.info("Compiling the %s executable (compile_only: nothing runs)...", kind)
        executable.compile(**batch) if isinstance(batch, dict) else executable.compile(*batch)

    # ---- Lightning hooks -------------------------------------------------------------------------------------------
    @override
    def setup_optimizers(self, trainer: L.Trainer) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) > 1:
            raise MisconfigurationException(
                f"The IPU runs one optimizer inside its training executable; got {len(self.optimizers)}."
            )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return self.hf_prepare_loader(dataloader, training=bool(trainer is not None and trainer.training))

    @override
    def teardown(self) -> None:
        inference = self.inference_model.executables() if self.inference_model is not None else []
        for executable in (self.training_model, *inference):
            if executable is not None:
                executable.destroy()  # copies the trained weights back to the host first
        if self.generation is not None:
            self.generation.destroy()
        self.training_model = self.inference_model = self.generation = None
        self._options.clear()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="Graphcore IPUs through poptorch (hflight)")
