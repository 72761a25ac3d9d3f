"""``IPUAccelerator``: Lightning's accelerator for Graphcore IPUs (name ``"ipu"``).

poptorch moves data and weights between the host and the IPUs itself, so for Lightning the model and the batches
stay on the host (the CPU device); the number of IPUs comes from the ``IPUConfig`` (replication x IPUs per
replica), not from ``devices``.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.accelerators.registry import _AcceleratorRegistry
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from hflight.ipu.runtime import require_poptorch


class IPUAccelerator(Accelerator):
    """Graphcore IPUs through poptorch. Constructing it without poptorch raises a message saying what to install."""

    def __init__(self) -> None:
        super().__init__()
        require_poptorch()

    @override
    def setup_device(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise MisconfigurationException(f"The IPU strategy keeps the model on the host (CPU) device, got {device}.")

    @override
    def teardown(self) -> None:
        pass

    @staticmethod
    @override
    def parse_devices(devices: Any) -> int:
        if isinstance(devices, (list, tuple)):
            return len(devices)
        if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
            return int(devices)
        if isinstance(devices, int):
            return devices
        raise MisconfigurationException(f"IPUAccelerator: devices must be a count of IPUs, got {devices!r}.")

    @staticmethod
    @override
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("cpu")]  # the host: poptorch owns the IPUs

    @staticmethod
    @override
    def auto_device_count() -> int:
        return 1

    @staticmethod
    @override
    def is_available() -> bool:
        try:
            poptorch = require_poptorch()
        except ModuleNotFoundError:
            return False
        return bool(poptorch.ipuHardwareIsAvailable())

    @staticmethod
    @override
    def name() -> str:
        return "ipu"

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: _AcceleratorRegistry) -> None:
        if cls.name() not in accelerator_registry:
            accelerator_registry.register(cls.name(), cls, description="Graphcore IPUs through poptorch (hflight)")
