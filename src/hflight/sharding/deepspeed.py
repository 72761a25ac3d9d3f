"""DeepSpeed as transformers runs it (``deepspeed=<config>``, ZeRO stages 0-3), on Lightning's ``DeepSpeedStrategy``,
on CUDA and on DeepSpeed's CPU accelerator (gloo).

transformers hands the DeepSpeed engine the model, its own optimizer and learning-rate schedule (unless the config names
DeepSpeed's), the config with its ``"auto"`` values filled from the arguments (``hflight.arguments.deepspeed``),
``gradient_accumulation_steps`` included, and then, per micro-batch: the accumulation boundary
(``set_gradient_accumulation_boundary``), ``engine.backward(loss, scale_wrt_gas=False)`` (the Trainer scales the loss
for accumulation itself), and at the boundary ``engine.step()``, which clips (``gradient_clipping``), steps the
optimizer and zeroes the gradients; the gradient norm logged is the engine's. This strategy does the same through
hflight's backend hooks. Lightning's strategy refuses every accelerator but CUDA and hands DeepSpeed a GPU index; on the
CPU it is given the process's local rank, which DeepSpeed's CPU accelerator takes.

Checkpoints (``hflight.checkpoints.forms.DeepSpeedState``): DeepSpeed's own ``global_step<N>/`` folder (every process
writes its partition), ``latest`` and ``zero_to_fp32.py``, as transformers writes them; the model files beside them
when the weights can be gathered (ZeRO 0-2 always, ZeRO-3 with ``stage3_gather_16bit_weights_on_model_save``, as in
transformers).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from typing_extensions import override

from hflight.arguments.deepspeed import DeepSpeedConfigResolver
from hflight.checkpoints.forms import CheckpointForm, DeepSpeedState
from hflight.run.backend import HFBackend


class HFDeepSpeedStrategy(DeepSpeedStrategy, HFBackend):
    """Lightning's ``DeepSpeedStrategy`` on transformers' resolved config (see the module docstring).

    Args:
        resolver: the config with its ``"auto"`` values filled from the arguments
            (``hflight.arguments.deepspeed.DeepSpeedConfigResolver``; the rest once the model and the run's length are
            known, before the engine is built).
        process_group_backend: ``ddp_backend`` (default: NCCL on CUDA, gloo on the CPU).
        timeout: ``ddp_timeout``.
    """

    strategy_name = "hflight_deepspeed"

    def __init__(self, resolver: DeepSpeedConfigResolver, **process_group: Any) -> None:
        super().__init__(config=resolver.config, **process_group)
        self.hf_deepspeed_resolver = resolver

    # ---- the CPU as well as CUDA ------------------------------------------------------------------------------------
    @property
    def _on_cpu(self) -> bool:
        return self.root_device.type == "cpu"

    @override
    def setup_environment(self) -> None:
        if self._on_cpu:  # Lightning's own refuses any accelerator but CUDA; DeepSpeed has a CPU accelerator
            DDPStrategy.setup_environment(self)
            return
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        if not self._on_cpu:
            super().setup_distributed()
            return
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()  # Lightning's checks of GPU indices do not apply
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @property
    def _device_rank(self) -> int:
        return self.local_rank if self._on_cpu else self.root_device.index

    @override
    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        import deepspeed

        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, deepspeed_optimizer

    @override
    def _initialize_deepspeed_inference(self, model: Any) -> None:
        if not self._on_cpu:
            super()._initialize_deepspeed_inference(model)
            return
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        # Lightning's evaluation engine, with the process's rank for DeepSpeed's CPU accelerator
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        config.update({key: self.config[key] for key in ("fp16", "bf16") if key in self.config})
        if self.zero_stage_3:
            config["zero_optimization"] = self.config["zero_optimization"]
            config["zero_allow_untested_optimizer"] = self.config.get("zero_allow_untested_optimizer", True)
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank), config=config, model=model, optimizer=None,
            lr_scheduler=None, model_parameters=[], dist_init_required=False,
        )  # fmt: skip

    @override
    def _format_batch_size_and_grad_accum_config(self) -> None:
        # transformers' config keeps its gradient_accumulation_steps (the engine accumulates, hflight tells it the
        # boundary); Lightning's would refuse it and use its own accumulation
        self.config.setdefault("train_micro_batch_size_per_gpu", 1)
        self.config.setdefault("gradient_clipping", 0.0)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.setdefault("scale_wrt_gas", False)  # the loss is already scaled for accumulation, as transformers'
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    # ---- HFBackend ------------------------------------------------------------------------------------------------
    @override
    def hf_run_planned(self, args: Any, model: torch.nn.Module, num_training_steps: int) -> None:
        """The config's values that need the model and the run's length (ZeRO buckets from the hidden size, the
        scheduler's steps), filled in place before Lightning builds the engine, as transformers fills them."""
        self.hf_deepspeed_resolver.finalize(args, model, num_training_steps)

    @override
    @contextlib.contextmanager
    def hf_micro_batch(self, strategy: Any, last: bool, sync_each_batch: bool = False) -> Iterator[None]:
        # sync_each_batch changes nothing under DeepSpeed, as in transformers (it enters no no_sync there anyway)
        self.deepspeed_engine.set_gradient_accumulation_boundary(is_boundary=last)
        yield

    @override
    def hf_optimizer_step(self, module: L.LightningModule) -> bool:
        """``engine.step()``: clipping, the optimizer's step and zeroed gradients, at the accumulation boundary; then
        ``on_pre_optimizer_step`` with the engine's gradient norm (transformers' order under DeepSpeed). False when
        fp16's loss scaler skipped the step."""
        engine = self.deepspeed_engine
        engine.step()
        norm = engine.get_global_grad_norm()
        module.pre_optimizer_step(norm.item() if torch.is_tensor(norm) else norm)
        return bool(engine.was_step_applied())

    @override
    def hf_clip_grad_norm(self, parameters: Any, max_norm: float) -> torch.Tensor | None:
        """The engine clips at its own step (``gradient_clipping``): nothing is clipped here, and the norm is the
        engine's last (None before its first step), as accelerate's ``clip_grad_norm_`` under DeepSpeed."""
        return self.deepspeed_engine.get_global_grad_norm()

    @override
    def hf_checkpoint_state(self) -> CheckpointForm:
        return DeepSpeedState(self.deepspeed_engine, self.hf_deepspeed_resolver.config)
