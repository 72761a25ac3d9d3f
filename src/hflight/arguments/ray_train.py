"""Ray Train's workers as a launch: the processes of a ``ray.train.torch.TorchTrainer``, connected by Ray.

Ray's recipe for transformers runs the training function in ``ScalingConfig(num_workers=N)`` worker processes (Ray
actors). Before the function runs, Ray's ``TorchConfig`` backend has connected the workers into torch's default process
group (gloo on CPUs, NCCL on GPUs, ``env://`` at worker 0's address) and set torch's launch variables in each
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``/``MASTER_PORT``, and
``ACCELERATE_TORCH_DEVICE``, the worker's device). transformers' ``Trainer`` trains across them through accelerate's
state, which adopts the group; hflight does the same from here:

- :func:`worker` says whether this process is such a worker (Ray's train context answers, and the group is up), with
  its ranks as Ray's context gives them (``ray.train.get_context()``: world size and rank, local rank and size, node
  rank); ``hflight.arguments.cluster`` then calls the launch ``"ray"``, spans the run over every worker, and leaves the
  group to Ray (``hflight.arguments.process_group`` connects nothing: the group exists; Ray destroys it when the
  workers end);
- :func:`lightning_environment` is the cluster environment Lightning is given, reading the same ranks (Lightning's own
  choice would be wrong inside Ray: no variable of its environments is Ray's, and Ray clusters run on SLURM or
  Kubernetes, whose variables the workers inherit and Lightning would read).

Ray is never imported here: a process that has not imported ``ray.train`` is no Ray Train worker, and ``import
hflight`` stays light. A worker of Ray Tune (``hyperparameter_search(backend="ray")``) is no launch: its trial is one
process, and Ray's context refuses to answer there.

May import: nothing of hflight (it is below ``hflight.arguments.cluster``).
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["RayWorker", "lightning_environment", "worker"]


@dataclass(frozen=True)
class RayWorker:
    """One worker of a Ray Train run, as Ray's train context describes it."""

    world_size: int
    global_rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    experiment: str


#: the answer, for the process group it was given for (hflight asks for the ranks at every step: Ray is asked once per
#: group; the group is known by its id, not held, so that it goes when it is destroyed)
_ANSWERED: list[tuple[tuple[int, int, int], RayWorker | None]] = []


def worker() -> RayWorker | None:
    """This process as a worker of a Ray Train run whose process group Ray made (None: not a Ray Train worker, or
    one with no torch process group, such as a worker of a non-torch Ray trainer)."""
    if "ray.train" not in sys.modules:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = (id(dist.group.WORLD), dist.get_world_size(), dist.get_rank())
    if _ANSWERED and _ANSWERED[0][0] == group:
        return _ANSWERED[0][1]
    found = _from_context(sys.modules["ray.train"], dist)
    _ANSWERED[:] = [(group, found)]
    return found


def _from_context(train: Any, dist: Any) -> RayWorker | None:
    try:
        context = train.get_context()
        found = RayWorker(
            world_size=int(context.get_world_size()),
            global_rank=int(context.get_world_rank()),
            local_rank=int(context.get_local_rank()),
            local_world_size=int(context.get_local_world_size()),
            node_rank=int(context.get_node_rank()),
            experiment=str(context.get_experiment_name()),
        )
    except Exception:  # noqa: BLE001 - Ray refuses outside a training function (the driver, a Tune trial): no launch
        return None
    if found.world_size != dist.get_world_size() or found.global_rank != dist.get_rank():
        return None  # a group of the script's own, not Ray's: not Ray's launch
    return found


def lightning_environment() -> Any:
    """Lightning's cluster environment for a Ray Train worker: ranks from Ray's context, the rendezvous Ray set."""
    return _environment_class()()


@functools.cache
def _environment_class() -> type:
    from lightning.fabric.plugins.environments import ClusterEnvironment

    class RayTrainEnvironment(ClusterEnvironment):
        """The workers of a Ray Train run: Ray started them and connected their process group; the ranks are Ray's
        (Lightning's ``set_world_size``/``set_global_rank`` cannot change them)."""

        @property
        def creates_processes_externally(self) -> bool:
            return True

        @property
        def main_address(self) -> str:
            return os.environ.get("MASTER_ADDR", "127.0.0.1")

        @property
        def main_port(self) -> int:
            return int(os.environ.get("MASTER_PORT", "0"))

        @staticmethod
        def detect() -> bool:
            return worker() is not None

        def _worker(self) -> RayWorker:
            found = worker()
            if found is None:
                raise RuntimeError("RayTrainEnvironment outside a Ray Train worker (no train context, or no group)")
            return found

        def world_size(self) -> int:
            return self._worker().world_size

        def set_world_size(self, size: int) -> None:
            """Nothing: the world is Ray's (``hflight.run.launch_check`` refuses a strategy that spans another)."""

        def global_rank(self) -> int:
            return self._worker().global_rank

        def set_global_rank(self, rank: int) -> None:
            """Nothing: the rank is Ray's."""

        def local_rank(self) -> int:
            return self._worker().local_rank

        def node_rank(self) -> int:
            return self._worker().node_rank

        def teardown(self) -> None:
            """Nothing: the variables and the group are Ray's (an ``evaluate()`` after ``train()`` still needs them)."""

    return RayTrainEnvironment
