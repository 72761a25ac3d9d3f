"""``Trainer.accelerator`` for code written against transformers' ``Trainer``, answered by the Lightning run.

transformers' ``Trainer`` keeps an ``accelerate.Accelerator`` in ``self.accelerator``, built in
``create_accelerator_and_postprocess`` from ``args.accelerator_config``, and its callbacks, integrations and subclasses
read it: the process layout (``num_processes``, ``is_main_process``, ...), ``sync_gradients``, the loader settings,
``gather_for_metrics`` in an evaluation loop, ``unwrap_model`` before saving, ``backward`` in a custom
``training_step``. hflight has no accelerate state (Lightning owns devices, processes and precision), so
:class:`RunAccelerator` answers with the same values from the run in progress: backward through the
``LightningModule``, collectives through the run's :class:`~hflight.run.distributed.World`, autocast as
accelerate's (the model's forward, ``hflight.run.autocast``), loaders dealt by
:func:`~hflight.run.loaders.prepare_loader`. Outside a run it answers from the arguments (one process on
``args.device``, or the launcher's). ``distributed_type`` is accelerate's own enum;
``state`` is a view of the run with ``AcceleratorState``'s names (creating accelerate's state would start a second
process state beside Lightning's), or, with ``accelerator_config['use_configured_state']``, the accelerate state the
user made. What cannot exist on Lightning raises an ``AttributeError`` naming what to use
(docs/coming-from-transformers.md lists the whole surface).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hflight._util import model_tp_size
from hflight.arguments import process_group
from hflight.arguments.lightning_kwargs import precision_for
from hflight.arguments.training_args import gradient_accumulation_plugin_kwargs
from hflight.run.autocast import DTYPES, autocast_of, unscale_gradients, unwrap_forward, wrap_forward
from hflight.run.distributed import World
from hflight.run.loaders import LoaderSharding, LoaderState, prepare_loader
from hflight.surface import RunView

logger = logging.getLogger(__name__)

#: accelerate ``Accelerator`` members that hflight's does not have, and what to use instead.
NOT_ON_LIGHTNING: dict[str, str] = {
    "prepare_optimizer": "the optimizer is built by Trainer.create_optimizer and stepped by hflight's loop",
    "prepare_scheduler": "the scheduler is built by Trainer.create_scheduler and stepped by hflight's loop",
    "prepare_data_loader": "trainer.accelerator.prepare(dataloader)",
    "save_state": "Trainer.save_model / the checkpoint-N folders (save_strategy, docs/checkpoints.md)",
    "load_state": "Trainer.train(resume_from_checkpoint=...)",
    "register_for_checkpointing": "a TrainerCallback with state (transformers' ExportableState), saved in checkpoints",
    "save_model": "Trainer.save_model",
    "skip_first_batches": "resume through Trainer.train(resume_from_checkpoint=...), which continues the training "
    "data from the checkpoint's data position",
    "join_uneven_inputs": "accelerator_config={'even_batches': True} (every process gets as many batches)",
    "optimizer_step_was_skipped": "TrainerState: hflight's loop steps the scheduler only when the optimizer stepped",
    "init_trackers": "report_to (transformers' integration callbacks)",
    "log": "Trainer.log",
    "get_tracker": "the integration callbacks of report_to (trainer.callback_handler.callbacks)",
    "torch_device_mesh": "trainer.lightning_trainer.strategy.device_mesh (FSDP2 runs)",
}

#: accelerate's ``DistributedType`` member names for several processes on a device type.
_MULTI = {"cpu": "MULTI_CPU", "cuda": "MULTI_GPU", "xpu": "MULTI_XPU", "npu": "MULTI_NPU", "mlu": "MULTI_MLU",
          "hpu": "MULTI_HPU", "musa": "MULTI_MUSA"}  # fmt: skip
#: Lightning precision -> accelerate's ``mixed_precision``.
_MIXED_PRECISION = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16",
                    "transformer-engine": "fp8"}  # fmt: skip


def _distributed_type_member(strategy: Any, processes: int, device_type: str) -> str:
    """accelerate's ``DistributedType`` member name for a Lightning strategy (None: before any run) on ``processes``."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, XLAStrategy

    kinds = ((DeepSpeedStrategy, "DEEPSPEED"), (FSDPStrategy, "FSDP"), (ModelParallelStrategy, "FSDP"),
             (XLAStrategy, "XLA"))  # fmt: skip
    for kind, member in kinds:
        if isinstance(strategy, kind):
            return member
    return _MULTI.get(device_type, "MULTI_GPU") if processes > 1 else "NO"


class GradientState(LoaderState):
    """accelerate's ``GradientState`` as transformers' ``Trainer`` configures it: ``num_steps`` 1 (transformers
    accumulates itself; ``args.gradient_accumulation_steps`` holds the count), ``sync_gradients`` True on the
    micro-batch that ends an accumulation cycle (and outside training), the prepared loaders being iterated
    (``end_of_dataloader``, ``remainder``), and ``plugin_kwargs``: ``gradient_accumulation_kwargs`` as accelerate's
    ``GradientAccumulationPlugin`` keeps them (the values that differ from its defaults)."""

    def __init__(self, plugin_kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.plugin_kwargs = plugin_kwargs
        self.sync_gradients = True

    @property
    def num_steps(self) -> int:
        return self.plugin_kwargs.get("num_steps", 1)

    @property
    def adjust_scheduler(self) -> bool:
        return self.plugin_kwargs.get("adjust_scheduler", False)

    @property
    def sync_with_dataloader(self) -> bool:
        return self.plugin_kwargs.get("sync_with_dataloader", True)

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """accelerate's setter (transformers' own loop calls it)."""
        self.sync_gradients = sync_gradients


class RunState:
    """``trainer.accelerator.state``: the run's layout under ``AcceleratorState``'s names (not accelerate's object:
    creating one would start accelerate's own process state beside Lightning's)."""

    _NAMES = ("num_processes", "process_index", "local_process_index", "device", "distributed_type", "mixed_precision",
              "is_main_process", "is_local_main_process", "use_distributed", "wait_for_everyone", "print",
              "main_process_first", "local_main_process_first")  # fmt: skip

    def __init__(self, accelerator: RunAccelerator) -> None:
        self._accelerator = accelerator

    initialized = True
    debug = False

    @property
    def backend(self) -> str | None:
        """The ``torch.distributed`` backend of the run's processes (None with one)."""
        dist = torch.distributed
        return dist.get_backend() if dist.is_available() and dist.is_initialized() else None

    @property
    def deepspeed_plugin(self) -> Any:
        """accelerate's ``DeepSpeedPlugin`` of a DeepSpeed run (the arguments' own, as transformers hands it to its
        ``Accelerator``), else None: what TRL's ``prepare_deepspeed`` reads (its ``deepspeed_config``)."""
        return self._accelerator.accelerate_plugin("DEEPSPEED")

    @property
    def fsdp_plugin(self) -> Any:
        """accelerate's ``FullyShardedDataParallelPlugin`` of an FSDP run (built from ``args.fsdp_plugin_args`` as
        transformers builds it), else None: what TRL's ``prepare_fsdp`` reads."""
        return self._accelerator.accelerate_plugin("FSDP")

    def __getattr__(self, name: str) -> Any:
        _raise_from_property(self, name)
        if name in RunState._NAMES:
            return getattr(self._accelerator, name)
        raise AttributeError(f"trainer.accelerator.state has no {name!r} in hflight (it answers "
                             f"{', '.join(RunState._NAMES)}, backend, deepspeed_plugin, fsdp_plugin)")  # fmt: skip


class RunAccelerator:
    """accelerate's ``Accelerator`` surface that transformers ``Trainer`` code uses, on hflight's runs.

    Built where transformers builds its ``Accelerator`` (``Trainer.__init__``): ``gradient_accumulation_kwargs``'
    ``num_steps`` becomes ``args.gradient_accumulation_steps`` there, as in transformers.

    Args:
        current_run: returns the run in progress (or the last one), None before any.
        args: the trainer's ``TrainingArguments`` (device and ranks before any run, ``accelerator_config``).
        model: returns the trainer's model (``parallelism_config`` of a model sharded at load time).
    """

    def __init__(
        self, current_run: Callable[[], RunView | None], args: Any, model: Callable[[], Any] = lambda: None
    ) -> None:
        self._current_run = current_run
        self._args = args
        self._model = model
        self._built_parallelism: tuple[Any, Any] | None = None  # (the model, the ParallelismConfig built for it)
        self._step = 0  # accumulate()'s count, as accelerate's Accelerator.step
        self._loader_settings: dict[str, Any] = {}  # set through dataloader_config, over accelerator_config's
        self._plugins: dict[str, Any] = {}  # accelerate_plugin's, one of each kind (TRL configures the one it reads)
        self.gradient_state = GradientState(gradient_accumulation_plugin_kwargs(args))
        if self.non_blocking and not args.dataloader_pin_memory:
            logger.warning(
                "`non_blocking` is enabled but `dataloader_pin_memory` is not. For the best performance, it's "
                "recommended to enable both."
            )
        _check_configured_state(args)

    @property
    def world(self) -> World:
        """hflight's own: the processes of the run in progress (or the last one); before any run, those the arguments
        describe. The facade's ranks and collectives come from here."""
        run = self._current_run()
        return run.world if run is not None else World(args=self._args)

    # ---- processes and device ----------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        run = self._current_run()
        return run.module.device if run is not None else self._args.device

    @property
    def num_processes(self) -> int:
        return self.world.size

    @property
    def process_index(self) -> int:
        return self.world.rank

    @property
    def local_process_index(self) -> int:
        run = self._current_run()
        return run.lightning_trainer.local_rank if run is not None else self._args.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def distributed_type(self) -> Any:
        """accelerate's ``DistributedType`` of the run (``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ``DEEPSPEED``, ``FSDP``,
        ``XLA``); before any run, of the strategy the arguments ask for."""
        from accelerate.utils import DistributedType

        run = self._current_run()
        if run is not None:
            strategy = run.lightning_trainer.strategy
        else:
            strategy = "DEEPSPEED" if self._args.deepspeed else "FSDP" if self._args.fsdp else None
        if isinstance(strategy, str):
            return DistributedType[strategy]
        return DistributedType[_distributed_type_member(strategy, self.num_processes, self.device.type)]

    @property
    def state(self) -> Any:
        """The accelerate state ``use_configured_state`` took (``args.distributed_state``), else :class:`RunState`."""
        configured = self._args.distributed_state if _configured(self._args) else None
        return configured if configured is not None else RunState(self)

    @property
    def mixed_precision(self) -> str:
        """``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``: the run's precision (before any run, the arguments')."""
        run = self._current_run()
        if run is None:
            return getattr(self._args, "mixed_precision", "no")
        return _MIXED_PRECISION.get(str(run.lightning_trainer.precision), "no")

    @property
    def parallelism_config(self) -> Any:
        """accelerate's ``ParallelismConfig`` of the run: the arguments' (transformers hands its ``Accelerator``
        ``args.parallelism_config``); for a model sharded at load time (tensor parallelism) without one, the one
        transformers builds from the model (its ``tp_size``, and its ``distributed_config.dp_size`` as
        ``dp_shard_size``; with one, transformers writes those two sizes into it, which hflight's arguments check
        requires to be the same already); None otherwise."""
        config = getattr(self._args, "parallelism_config", None)
        model = self._model()
        size = model_tp_size(model)
        if config is not None or size == 1:
            return config
        built = self._built_parallelism
        if built is None or built[0] is not model:
            from accelerate import ParallelismConfig

            layout = getattr(getattr(model, "config", None), "distributed_config", None)
            replicas = int(getattr(layout, "dp_size", 1) or 1)
            built = self._built_parallelism = (model, ParallelismConfig(tp_size=size, dp_shard_size=replicas))
        return built[1]

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """accelerate's ``prepare_model`` for a model used only for evaluation (``evaluation_mode=True``: TRL's
        reference and reward models): placed on the run's device (unless ``device_placement`` is False), its forward
        autocast and its outputs float32 under mixed precision, as accelerate's (kept on the model; ``unwrap_model(
        model, keep_fp32_wrapper=False)`` removes it). The model being trained is prepared by Lightning's strategy and
        hflight's run (``hflight.run.autocast``) when ``train()`` runs.

        Raises:
            NotImplementedError: ``evaluation_mode`` False (the trained model is Lightning's to wrap).
        """
        if not evaluation_mode:
            raise NotImplementedError(
                "trainer.accelerator.prepare_model(model) for training: Lightning's strategy wraps the model when "
                "Trainer.train() runs (trainer.lightning_trainer); prepare_model(..., evaluation_mode=True) places a "
                "model used for evaluation only."
            )
        settings = self._autocast_settings()
        if settings is not None:
            wrap_forward(model, *settings)
        return model.to(self.device) if device_placement is not False else model

    def _autocast_settings(self) -> tuple[str, torch.dtype] | None:
        """accelerate's autocast (device type, dtype) when its ``native_amp`` is on: the run's mixed precision; before
        any run, the arguments' (bf16; fp16 off the CPU; none under DeepSpeed, whose engine casts)."""
        run = self._current_run()
        if run is not None:
            plugin = autocast_of(run.lightning_trainer)
            return None if plugin is None else (plugin.device, plugin.dtype)
        if getattr(self._args, "deepspeed", None):
            return None
        dtype = DTYPES.get(precision_for(self._args))
        return None if dtype is None else (self.device.type, dtype)

    def wait_for_everyone(self) -> None:
        self.world.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        with self._args.main_process_first(local=False):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        with self._args.main_process_first(local=True):
            yield

    # ---- accelerator_config ------------------------------------------------------------------------------------
    @property
    def _sharding(self) -> LoaderSharding:
        configured = LoaderSharding.from_config(self._args.accelerator_config, self._args.data_seed)
        return dataclasses.replace(configured, **self._loader_settings)

    @property
    def dataloader_config(self) -> LoaderSettings:
        """accelerate's ``dataloader_config``: the loader settings of ``accelerator_config`` (``dispatch_batches``,
        ``split_batches``, ...); one set here holds for the loaders prepared after it and leaves the arguments as
        they are, as accelerate's own copy does (TRL's GRPO sets ``dispatch_batches`` for an iterable eval set)."""
        return LoaderSettings(lambda: self._sharding, self._loader_settings)

    split_batches = property(lambda self: self._sharding.split_batches)
    dispatch_batches = property(lambda self: self._sharding.dispatch_batches)
    even_batches = property(lambda self: self._sharding.even_batches)
    use_seedable_sampler = property(lambda self: self._sharding.use_seedable_sampler)
    non_blocking = property(lambda self: self._sharding.non_blocking)

    def prepare(self, *objects: Any) -> Any:
        """Each ``DataLoader`` dealt to this process as ``accelerator_config`` says (accelerate's
        ``prepare_data_loader``: ``hflight.run.loaders``). Models, optimizers and schedulers are Lightning's to
        prepare, when ``Trainer.train()`` runs: passing one raises."""
        prepared = []
        for item in objects:
            if not isinstance(item, torch.utils.data.DataLoader) and not hasattr(item, "sharding"):
                raise NotImplementedError(
                    f"trainer.accelerator.prepare({type(item).__name__}): hflight prepares data loaders only; "
                    "Lightning's strategy wraps the model and runs the optimizer and scheduler when Trainer.train() "
                    "runs"
                )
            prepared.append(prepare_loader(item, *self.world.data_parallel, self._sharding, self.gradient_state))
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    # ---- gradient accumulation ---------------------------------------------------------------------------------
    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    @property
    def gradient_accumulation_steps(self) -> int:
        """1, as in transformers' ``Trainer`` (it accumulates ``args.gradient_accumulation_steps`` batches itself)."""
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self.gradient_state.plugin_kwargs["num_steps"] = steps

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """accelerate's ``accumulate``: counts the call, sets ``sync_gradients`` (every ``gradient_accumulation_steps``
        calls, 1 in transformers' ``Trainer``: every call), and keeps the gradients of ``models`` local when it does
        not sync (unless ``sync_each_batch``)."""
        state = self.gradient_state
        if state.sync_with_dataloader and state.end_of_dataloader:
            self._step, state.sync_gradients = 0, True
        else:
            self._step += 1
            state.sync_gradients = self._step % state.num_steps == 0
        allowed = state.sync_gradients or (self.use_distributed and state.plugin_kwargs.get("sync_each_batch", False))
        with contextlib.ExitStack() as stack:
            for model in models if not allowed else ():
                stack.enter_context(self.no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """``model.no_sync()`` with several processes (a ``DistributedDataParallel`` model), else nothing."""
        context = getattr(model, "no_sync", contextlib.nullcontext) if self.use_distributed else contextlib.nullcontext
        with context():
            yield

    # ---- the step ----------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward through the run's LightningModule (its precision plugin scales the loss, its strategy syncs).
        Outside ``train()`` (a ``training_step`` called by hand, as transformers' own tests do), ``loss.backward``, as
        accelerate's backward without a gradient scaler; fp16 on CUDA, whose scaler exists only in a run, raises."""
        run = self._current_run()
        if run is None or not run.fitting:
            if self.mixed_precision == "fp16" and loss.device.type == "cuda":
                raise RuntimeError(
                    "accelerator.backward() outside Trainer.train() with fp16 on CUDA: the loss scaler is the run's "
                    "precision plugin's; call it inside train() (a callback or training_step override)."
                )
            loss.backward(**kwargs)
            return
        run.module.manual_backward(loss, **kwargs)

    def autocast(self, autocast_handler: Any = None) -> contextlib.AbstractContextManager:
        """accelerate's ``autocast``: ``torch.autocast`` with the run's mixed precision (before any run, the
        arguments') and ``autocast_handler``'s arguments (accelerate's ``AutocastKwargs``, or a dict of
        ``torch.autocast`` arguments; ``enabled=False`` turns it off); nothing in full precision or under DeepSpeed."""
        settings = self._autocast_settings()
        if settings is None:
            return contextlib.nullcontext()
        handler = autocast_handler
        kwargs = handler.to_kwargs() if hasattr(handler, "to_kwargs") else dict(handler or {})
        device_type, dtype = settings
        return torch.autocast(device_type=device_type, dtype=dtype, **kwargs)

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """accelerate's: fp16's gradient scaler, the one the run in progress (or the last one) scales its losses and
        steps its optimizer with (its precision plugin's); None without one (full precision, bf16, DeepSpeed's own
        loss scaling, before any run)."""
        run = self._current_run()
        return getattr(run.lightning_trainer.precision_plugin, "scaler", None) if run is not None else None

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """accelerate's: the gradients' total norm, clipped to ``max_norm``, over the whole model however the run
        holds it. With fp16's gradient scaler the run's optimizers' gradients are unscaled first (every optimizer,
        fused or not, once per step: accelerate's ``unscale_gradients``). During a run the 2-norm is the run's own
        (what the training loop clips and logs: a tensor-parallel model's norm completed over its mesh, where torch's
        refuses a mix of DTensor and plain gradients); other norms, and outside a run, torch's ``clip_grad_norm_``."""
        run = self._current_run()
        if run is not None and run.fitting:
            unscale_gradients(self.scaler, list(run.lightning_trainer.optimizers))
        if run is not None and norm_type == 2:
            return run.backend.hf_clip_grad_norm(parameters, max_norm)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def unwrap_model(
        self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> nn.Module:
        """``model`` without the wrappers a strategy put around it (accelerate's ``extract_model_from_parallel``:
        only real wrappers, :func:`_unwrapped`; a model of the user's with a submodule named ``module`` is kept
        whole); a ``torch.compile`` model keeps its compiled wrapper (its inner model unwrapped) unless
        ``keep_torch_compile=False``; ``keep_fp32_wrapper=False``: without the autocast forward of mixed precision
        either (removed from the model, as accelerate's)."""
        from torch._dynamo.eval_frame import OptimizedModule

        compiled = model if isinstance(model, OptimizedModule) else None
        inner = _unwrapped(model._orig_mod if compiled is not None else model)
        if not keep_fp32_wrapper:
            unwrap_forward(inner)
        if compiled is None or not keep_torch_compile:
            return inner
        if compiled._orig_mod is not inner:  # accelerate's: the compiled wrapper around the unwrapped model
            compiled._orig_mod = inner
        return compiled

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The model's full state dict, as accelerate's: gathered from an FSDP2 model's shards (on every process, as
        accelerate's ``broadcast_from_rank0``), else the (unwrapped) model's own."""
        if self.distributed_type.name == "DEEPSPEED":
            raise NotImplementedError(
                "trainer.accelerator.get_state_dict under DeepSpeed: use Trainer.save_model(), which gathers ZeRO "
                "weights as transformers does"
            )
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in model.parameters()):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
            return get_model_state_dict(model, options=options)
        return (self.unwrap_model(model) if unwrap else model).state_dict()

    def free_memory(self, *objects: Any) -> list[None]:
        """accelerate's: every object given replaced by None, the garbage collected, the device's cache emptied."""
        released: list[None] = [None] * len(objects)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self._step = 0
        return released

    clear = free_memory

    # ---- collectives -------------------------------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        """Every process's tensors concatenated along the first dimension (nested lists, tuples, dicts; a 0-d tensor
        counts as one row); one process: as given. Every process, as accelerate's: under tensor parallelism each
        rank of a tensor-parallel group adds its rows (``gather_for_metrics``, what an evaluation loop calls, gathers
        once per data-parallel replica, as the loop's own gathers)."""
        if self.use_distributed:
            _tensors_only(tensor, "gather")
        return self.world.gather(tensor, whole_world=True)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """``gather`` (or, for objects, every process's list joined), then, on the last batch of a prepared loader,
        only the samples that are not repeats (accelerate's ``remainder``). Under tensor parallelism once per
        data-parallel replica, as the loop's evaluation gathers and as the loaders deal the batches (accelerate's
        gathers each tensor-parallel rank's copy, which its remainder cut then miscounts)."""
        try:
            _tensors_only(input_data, "gather_for_metrics")
        except TypeError:
            use_gather_object = True
        data = self.world.gather_objects(input_data) if use_gather_object else self.world.gather(input_data)
        state = self.gradient_state
        if not state.end_of_dataloader or state.remainder <= 0:
            return data
        try:
            if use_gather_object:
                return data[: state.remainder]
            return _apply(data, lambda t: t[: state.remainder])
        except Exception:  # noqa: BLE001 - accelerate's rule: what cannot be cut (a 0-d tensor, a scalar) as gathered
            return data

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Each tensor padded along ``dim`` with ``pad_index`` to the largest size any process has (at the start
        with ``pad_first``), over every process as accelerate's."""
        _tensors_only(tensor, "pad_across_processes")
        pad = functools.partial(self.world.pad_across_processes, dim=dim, pad_index=pad_index, whole_world=True,
                                pad_first=pad_first)  # fmt: skip
        return _apply(tensor, pad)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Each tensor (a copy) summed across processes (``"sum"``; also ``"none"``, as accelerate), averaged
        (``"mean"``) or maximised (``"max"``). ``scale`` only acts on XLA devices in accelerate, so here neither."""
        if reduction not in ("sum", "mean", "max", "none"):
            raise ValueError(f"reduce: reduction must be 'sum', 'mean', 'max' or 'none', got {reduction!r}")
        _tensors_only(tensor, "reduce")
        processes = self.num_processes

        def reduce_one(value: torch.Tensor) -> torch.Tensor:
            copy = value.clone()
            if processes > 1:
                op = torch.distributed.ReduceOp.MAX if reduction == "max" else torch.distributed.ReduceOp.SUM
                torch.distributed.all_reduce(copy, op)
                if reduction == "mean":
                    copy /= processes
            return copy

        return _apply(tensor, reduce_one)

    def end_training(self) -> None:
        """Finish the run's loggers and end the process group (accelerate's ``end_training``), as hflight ends it at
        exit (``hflight.arguments.process_group.end``)."""
        run = self._current_run()
        if run is not None:
            for logger_ in run.lightning_trainer.loggers:
                logger_.finalize("success")
        process_group.end()

    @property
    def deepspeed_plugin(self) -> Any:
        """accelerate's: the ``DeepSpeedPlugin`` of a DeepSpeed run, else None (``state.deepspeed_plugin``)."""
        return self.accelerate_plugin("DEEPSPEED")

    def accelerate_plugin(self, kind: str) -> Any:
        """accelerate's plugin of the run's ``kind`` (``"DEEPSPEED"``, ``"FSDP"``) as transformers' ``Accelerator``
        holds it, for the code that reads it (TRL's ``prepare_deepspeed``/``prepare_fsdp`` of a reference model):
        the arguments' ``deepspeed_plugin``, or a ``FullyShardedDataParallelPlugin`` of ``args.fsdp_plugin_args``,
        each given the run's mixed precision as accelerate's state gives it; None when the run is not of that kind
        (as accelerate's; a tensor-parallel run without ``fsdp`` has no FSDP plugin there either). hflight's own
        strategies are built from the arguments, not from these."""
        if self.distributed_type.name != kind:
            return None
        if kind not in self._plugins:
            self._plugins[kind] = _accelerate_plugin(kind, self._args, self.mixed_precision)
        return self._plugins[kind]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        _raise_from_property(self, name)
        advice = NOT_ON_LIGHTNING.get(name)
        what = f"use {advice}" if advice else "docs/coming-from-transformers.md lists what it offers"
        raise AttributeError(
            f"trainer.accelerator.{name}: hflight runs on Lightning, not accelerate, and its trainer.accelerator has "
            f"no {name!r}; {what}"
        )


class LoaderSettings:
    """``trainer.accelerator.dataloader_config``: reads the loader settings in force, records the ones set."""

    def __init__(self, current: Callable[[], LoaderSharding], overrides: dict[str, Any]) -> None:
        object.__setattr__(self, "_current", current)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._current(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        known = [f.name for f in dataclasses.fields(LoaderSharding)]
        if name not in known:
            raise AttributeError(f"trainer.accelerator.dataloader_config.{name}: hflight's loaders take {known} only")
        self._overrides[name] = value


def _apply(data: Any, function: Callable[[torch.Tensor], Any]) -> Any:
    """``function`` on every tensor of ``data`` (nested mappings, lists, tuples), the structure kept."""
    if torch.is_tensor(data):
        return function(data)
    if isinstance(data, Mapping):
        return type(data)({key: _apply(value, function) for key, value in data.items()})
    if isinstance(data, (list, tuple)):
        items = [_apply(value, function) for value in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    return data


def _accelerate_plugin(kind: str, args: Any, mixed_precision: str) -> Any:
    """accelerate's ``DeepSpeedPlugin`` (``kind`` "DEEPSPEED") or ``FullyShardedDataParallelPlugin`` ("FSDP") of
    ``args`` as transformers' ``Accelerator`` holds it (None: no such settings)."""
    if kind == "DEEPSPEED":
        plugin = getattr(args, "deepspeed_plugin", None)
        if plugin is not None:
            plugin.set_mixed_precision(mixed_precision)  # what accelerate's state does to the one it is given
        return plugin
    settings = getattr(args, "fsdp_plugin_args", None)
    if settings is None:
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(**settings)
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    return plugin


def _raise_from_property(owner: Any, name: str) -> None:
    """``__getattr__`` is called when a property raised ``AttributeError`` too: that property is run again here, so
    that its own error (about what it reads) is the one raised, never "has no <property>"."""
    member = getattr(type(owner), name, None)
    if isinstance(member, property) and member.fget is not None:
        member.fget(owner)


def _unwrapped(model: nn.Module) -> nn.Module:
    """``model`` without the wrappers accelerate's ``extract_model_from_parallel`` takes off
    (``DistributedDataParallel``, ``DataParallel``, DeepSpeed's engine, FSDP1's ``FullyShardedDataParallel``: their
    ``.module``), and the one of the Lightning run: the LightningModule its strategy wraps (hflight's ``HFModule``:
    its ``.model``). Any other module, whatever its attributes (a submodule named ``module``), is the model itself."""
    from hflight.run.module import HFModule

    wrappers: tuple[type, ...] = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers += (FullyShardedDataParallel,)
    deepspeed = sys.modules.get("deepspeed")  # a DeepSpeed engine exists only where deepspeed was imported
    if deepspeed is not None and hasattr(deepspeed, "DeepSpeedEngine"):
        wrappers += (deepspeed.DeepSpeedEngine,)
    while True:
        if isinstance(model, wrappers):
            model = model.module
        elif isinstance(model, HFModule):
            model = model.model
        else:
            return model


def _tensors_only(data: Any, operation: str) -> None:
    """accelerate's check: ``operation`` takes nested lists, tuples and mappings of tensors only."""
    if isinstance(data, Mapping):
        values = data.values()
    elif isinstance(data, (list, tuple)):
        values = data
    elif torch.is_tensor(data):
        return
    else:
        raise TypeError(
            f"Unsupported types ({type(data)}) passed to `{operation}`. Only nested list/tuple/dicts of objects that "
            "are valid for `is_torch_tensor` should be passed."
        )
    for value in values:
        _tensors_only(value, operation)


def _configured(args: Any) -> bool:
    """Whether the arguments' ``distributed_state`` is an accelerate state the user made (``use_configured_state``)."""
    return getattr(args, "accelerate_state_configured", False)


def _check_configured_state(args: Any) -> None:
    """With ``use_configured_state``, an ``AcceleratorState`` the user made must agree with the arguments' mixed
    precision: transformers' ``Accelerator`` refuses to change it (accelerate's own error)."""
    if not _configured(args):
        return
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state == {}:  # only a PartialState: nothing to disagree with
        return
    configured, wanted = AcceleratorState().mixed_precision, getattr(args, "mixed_precision", "no")
    if configured != wanted:
        raise ValueError(
            "AcceleratorState has already been initialized and cannot be changed, restart your runtime completely and "
            f"pass `mixed_precision='{wanted}'` to `Accelerator()` (it was made with {configured!r}; "
            "accelerator_config['use_configured_state']=True uses it as it is)."
        )
