"""Test stand-in, not product code: lets transformers' own FSDP route run on the CPU.

accelerate 1.15 turns a ``FullyShardedDataParallelPlugin`` into FSDP only for GPU-like devices (``MULTI_GPU``,
``MULTI_XPU``, ...: ``AcceleratorState.__init__``); on the CPU (``use_cpu``, ``MULTI_CPU``) it drops the plugin, so
transformers' Trainer, given ``--fsdp``, silently trains with DDP. With this folder on ``PYTHONPATH`` (Python imports
``sitecustomize`` at start-up), an ``Accelerator`` built with a plugin on ``MULTI_CPU`` takes the state accelerate
gives a GPU run: ``distributed_type = FSDP`` and the plugin (passed by transformers, or built from ``accelerate
launch``'s ``FSDP_*`` variables as accelerate builds it), so the rest (FSDP2 preparation, ``fully_shard`` over gloo,
the FSDP checkpoint writers and readers) is accelerate's and transformers' own code. The example script runs as
written. Used by ``tests/test_sharded_dropin.py``."""

import importlib.abc
import importlib.util
import os
import sys


def _patch(accelerate) -> None:
    from accelerate.utils import DistributedType

    original = accelerate.Accelerator.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        if fsdp_plugin is None and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            # accelerate launch's FSDP: the plugin accelerate builds from the FSDP_* variables
            fsdp_plugin = accelerate.utils.FullyShardedDataParallelPlugin()
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.state.distributed_type == DistributedType.MULTI_CPU:
            self.state.distributed_type = DistributedType.FSDP
            self.state.fsdp_plugin = fsdp_plugin

    accelerate.Accelerator.__init__ = __init__


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches ``accelerate`` right after its first import (importing it here would slow every process down)."""

    def find_spec(self, name, path, target=None):
        if name != "accelerate" or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)  # the spec of the real package (availability checks ask for it too)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _AfterImport())
