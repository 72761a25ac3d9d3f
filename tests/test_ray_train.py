"""Ray Train as a launcher (issue 48, item 1): Ray's documented recipe for transformers (``TorchTrainer(train_func,
scaling_config=ScalingConfig(num_workers=2, use_gpu=False))``; inside, the Trainer, ``RayTrainReportCallback``,
``prepare_trainer``, ``trainer.train()``, resuming from ``ray.train.get_checkpoint()``) run with
``transformers.Trainer`` and with ``hflight.Trainer`` (tests/ray_recipe.py; the import is the one difference), under
the same ``TorchTrainer``, on one local Ray instance of 2 CPUs (gloo) started once for the module: Ray's start and each
start of the workers (each importing torch and the library) are the cost, so the two runs are all there is.

transformers' run goes through. hflight's run loses its workers after step 2 (a callback raises at the start of step
3, as a lost node would); Ray starts new ones and hands them the step-2 checkpoint it was reported, from which they
resume. Both train data-parallel across the two workers in the process group Ray made, on the workers' shards of Ray
Data datasets (``prepare_trainer``'s loaders): every step's loss is transformers' on every rank (steps 1-2 before the
failure, 3-4 after the resume), and Ray's reports (metrics and checkpoints at steps 2 and 4) are transformers' (the
evaluation's timings aside; hflight's checkpoint adds its manifest).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from hflight.arguments import cluster, launcher_env, ray_train

from . import dropin, ray_recipe

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.torch")


#: what Ray's reports hold that is a clock reading, not a result
TIMINGS = {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}


def _fit(root: Path, library: str, fail_at: int | None = None) -> dict:
    """One ``TorchTrainer.fit`` of the recipe (Ray restarts lost workers once; ``fail_at``: the first workers fail at
    that step); what Ray reported and what each worker of each attempt recorded."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    output_dir = root / library
    result = TorchTrainer(
        ray_recipe.train_func,
        train_loop_config={"library": library, "output_dir": str(output_dir), "fail_at": fail_at},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=str(root / "ray"), name=library,
                             failure_config=FailureConfig(max_failures=1)),
        datasets=ray_recipe.datasets(),
    ).fit()  # fmt: skip
    reported = sorted(result.best_checkpoints, key=lambda pair: pair[1]["step"])
    records = {path.stem: json.loads(path.read_text()) for path in (output_dir / "records").iterdir()}
    return {"result": result, "reported": reported, "records": records}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Ray started once; transformers' run, and hflight's, whose first workers fail at step 3."""
    root = tmp_path_factory.mktemp("ray_train")
    path = os.pathsep.join([str(dropin.REPO_ROOT), str(dropin.REPO_ROOT / "src")])  # the workers import the recipe
    # Ray Train's controller polls its workers every 2 s by default: 0.2 s spares the idle waits of each fit
    env = {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        return {"transformers": _fit(root, "transformers"), "hflight": _fit(root, "hflight", fail_at=2)}
    finally:
        ray.shutdown()


def _untimed(logs: list[dict]) -> list[dict]:
    return [{key: value for key, value in entry.items() if key not in TIMINGS} for entry in logs]


def _files(checkpoint) -> dict[str, Path]:
    return {entry.name: entry for entry in Path(checkpoint.path, "checkpoint").iterdir()}


def _weights(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(_files(checkpoint)["model.safetensors"])


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_recipe_trains_across_the_workers_as_transformers_and_resumes(runs):
    """Each worker is a rank of one data-parallel run of world size 2 (the group Ray made), ``prepare_trainer``'s
    subclass feeds it its shard of the Ray Data datasets, and every step's loss is transformers' on every rank:
    steps 1-2 by the first workers, 3-4 by those Ray restarted from the step-2 checkpoint."""
    theirs, ours = runs["transformers"]["records"], runs["hflight"]["records"]
    assert set(theirs) == {"attempt-1-rank-0", "attempt-1-rank-1"}
    assert set(ours) == set(theirs) | {"attempt-2-rank-0", "attempt-2-rank-1"}
    expected = theirs["attempt-1-rank-0"]["losses"]
    assert [step for step, _ in expected] == [1, 2, 3, 4]
    step_2 = Path(runs["hflight"]["reported"][0][0].path).name
    for rank in (0, 1):
        assert theirs[f"attempt-1-rank-{rank}"]["losses"] == expected  # the logged loss is reduced over the ranks
        first, restarted = ours[f"attempt-1-rank-{rank}"], ours[f"attempt-2-rank-{rank}"]
        assert first["losses"] + restarted["losses"] == expected
        assert (first["resumed_from"], restarted["resumed_from"]) == (None, step_2)
        for record in (theirs[f"attempt-1-rank-{rank}"], first, restarted):
            assert record["world_size"] == record["group_size"] == 2
            assert record["trainer_class"] == "RayTransformersTrainer"  # prepare_trainer's subclass of the library's


@pytest.mark.subprocess
@pytest.mark.slow
def test_ray_reports_the_same_metrics_and_checkpoints(runs):
    """``RayTrainReportCallback`` reports each checkpoint (steps 2 and 4) with the metrics logged up to it: the same
    numbers as transformers' (the evaluation's timings aside), the same files (hflight's manifest beside them), the
    same weights and trainer state; the result's metrics are the last report's."""
    ours, theirs = runs["hflight"]["reported"], runs["transformers"]["reported"]
    assert [metrics["step"] for _, metrics in theirs] == [metrics["step"] for _, metrics in ours] == [2, 4]
    for (our_checkpoint, our_metrics), (checkpoint, metrics) in zip(ours, theirs):
        assert {"loss", "grad_norm", "learning_rate", "eval_loss"} <= set(metrics)
        assert _untimed([our_metrics]) == _untimed([metrics])
        # hflight's manifest beside them, no data position: the loader is Ray's own, over Ray Data's iterator (its
        # get_train_dataloader of prepare_trainer), which resumes as in transformers
        assert set(_files(our_checkpoint)) == set(_files(checkpoint)) | {"checkpoint_manifest.json"}
        our_weights, weights = _weights(our_checkpoint), _weights(checkpoint)
        assert our_weights.keys() == weights.keys()
        for key in weights:
            torch.testing.assert_close(our_weights[key], weights[key], rtol=0, atol=1e-6, msg=key)
        our_state = json.loads(_files(our_checkpoint)["trainer_state.json"].read_text())
        state = json.loads(_files(checkpoint)["trainer_state.json"].read_text())
        assert our_state["global_step"] == state["global_step"] == metrics["step"]
        assert _untimed(our_state["log_history"]) == _untimed(state["log_history"])
    assert _untimed([runs["hflight"]["result"].metrics]) == _untimed([theirs[-1][1]])


# ---- in this process: a Ray Train worker as hflight reads it (Ray's context stood in for) ---------------------------
@pytest.fixture
def ray_worker(monkeypatch):
    """This process as worker 3 of 4 of a Ray Train run, the second of two on node 1."""
    worker = ray_train.RayWorker(world_size=4, global_rank=3, local_rank=1, local_world_size=2, node_rank=1,
                                 experiment="exp")  # fmt: skip
    monkeypatch.setattr(ray_train, "worker", lambda: worker)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "12345")
    # what a Ray cluster on SLURM hands its workers: not this process's launch
    monkeypatch.setenv("SLURM_NTASKS", "1")
    return worker


def test_a_ray_worker_is_a_launch_read_from_rays_context(ray_worker):
    """Ray's context decides before SLURM's variables: the ranks, the layout Lightning is given (2 workers per node,
    2 nodes), the job's name, and Lightning's cluster environment with Ray's ranks and rendezvous."""
    assert cluster.environment() == "ray"
    assert cluster.ranks() == cluster.Ranks(world_size=4, global_rank=3, local_rank=1, node_rank=1)
    assert cluster.launched_layout() == cluster.Layout(devices=2, num_nodes=2)
    assert cluster.job_identity() == "ray train exp at 10.0.0.1:12345"
    environment = cluster.launcher_plugin("SIGUSR1")
    assert type(environment).__name__ == "RayTrainEnvironment" and environment.creates_processes_externally
    assert (environment.world_size(), environment.global_rank(), environment.local_rank(), environment.node_rank()) == (
        4, 3, 1, 1,
    )  # fmt: skip
    environment.set_world_size(1)
    environment.set_global_rank(0)  # Ray's, not Lightning's to change
    assert (environment.world_size(), environment.global_rank()) == (4, 3)
    assert (environment.main_address, environment.main_port) == ("10.0.0.1", 12345)


def test_outside_a_ray_train_worker_nothing_is_rays():
    """The driver (Ray imported, no training function running, no process group) is no Ray Train worker."""
    assert ray_train.worker() is None
    assert cluster.environment() != "ray"


def test_a_ray_workers_device_is_lightnings_for_its_local_rank(ray_worker):
    """``ACCELERATE_TORCH_DEVICE``, which Ray sets to each worker's device: on a GPU worker ``cuda:N`` is accepted where
    N is its local rank (the device Lightning picks for it), refused naming both otherwise; ``cpu`` on the CPU."""
    args = SimpleNamespace(use_cpu=False, accelerator="auto")
    launcher_env._device(args, {"ACCELERATE_TORCH_DEVICE": "cuda:1"}, lambda: "cuda")
    launcher_env._device(args, {"ACCELERATE_TORCH_DEVICE": "cpu"}, lambda: "cpu")
    with pytest.raises(launcher_env.LauncherEnvironmentError, match=r"'cuda:0'.*cuda:1, the device of local rank 1"):
        launcher_env._device(args, {"ACCELERATE_TORCH_DEVICE": "cuda:0"}, lambda: "cuda")
