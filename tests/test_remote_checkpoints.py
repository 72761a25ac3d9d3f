"""Checkpoints on object storage (issue 68): ``output_dir="s3://bucket/run"`` against a real S3 server process
(``moto_server``, tests/s3_server.py), through s3fs with the server's address as the endpoint.

What each step trained is the oracle (tests/jobs/trained_ids.py): a run stored in the bucket, killed mid-upload and
resumed on an empty disk trains the uninterrupted run's examples from its checkpoint on and ends on its weights."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from fsspec.registry import known_implementations

import hflight
from hflight.checkpoints.storage import ObjectStorage, StorageError, objects

from . import launch, s3_server
from .launch import JOBS

pytest.importorskip("s3fs")
pytest.importorskip("moto")
sys.path.insert(0, str(JOBS))
import trained_ids  # noqa: E402

BUCKET = "hflight-runs"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> str:
    with s3_server.moto_server(tmp_path_factory.mktemp("moto") / "server.log") as endpoint:
        yield endpoint


@pytest.fixture
def s3(server, monkeypatch, tmp_path):
    """A fresh bucket on the server; credentials in the environment; the staging folders under ``tmp_path``."""
    s3_server.reset(server)
    for name, value in s3_server.CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HFLIGHT_STAGING_DIR", str(tmp_path / "staging"))
    fs = s3_server.filesystem(server)
    fs.mkdir(BUCKET)
    return fs


def _digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).numpy().tobytes())
    return digest.hexdigest()


def _stored(fs, prefix: str) -> dict[str, list[str]]:
    """checkpoint name -> the files stored under it."""
    fs.invalidate_cache()
    found: dict[str, list[str]] = {}
    for path in fs.find(prefix):
        relative = path[len(prefix) + 1 :]
        if "/" in relative:
            name, rest = relative.split("/", 1)
            found.setdefault(name, []).append(rest)
    return found


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The script's uninterrupted run on the local disk: the ids per step and the final weights."""
    trainer, trained, _ = trained_ids.run(tmp_path_factory.mktemp("full"), trained_ids.source("map"), hflight)
    return trained, _digest(trainer.model)


# ---- the whole story -------------------------------------------------------------------------------------------
def test_sigkill_mid_upload_then_a_resume_on_an_empty_disk_ends_as_the_uninterrupted_run(
    s3, server, tmp_path, uninterrupted
):
    """save_async uploads in the background; SIGKILL while checkpoint-16's files go up: the bucket holds
    checkpoint-8 complete and a checkpoint-16 without its manifest. A resume on another (empty) staging folder takes
    checkpoint-8, trains the uninterrupted run's examples from step 9 and ends on its weights; its own checkpoint-16
    replaces the partial one."""
    url, full = f"s3://{BUCKET}/run", uninterrupted
    env = {**os.environ, "AWS_ENDPOINT_URL": server}
    killed = subprocess.run([sys.executable, str(JOBS / "remote_job.py"), str(tmp_path / "killed.json"), "--url", url,
                             "--staging", str(tmp_path / "machine1"), "--save-async", "--kill-at-upload", "16"],
                            env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-3000:]
    stored = _stored(s3, f"{BUCKET}/run")
    assert "checkpoint_manifest.json" in stored["checkpoint-8"]
    assert stored["checkpoint-16"] and "checkpoint_manifest.json" not in stored["checkpoint-16"]

    resumed = subprocess.run([sys.executable, str(JOBS / "remote_job.py"), str(tmp_path / "resumed.json"), "--url",
                              url, "--staging", str(tmp_path / "machine2"), "--save-async", "--resume", "true"],
                             env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    record = json.loads((tmp_path / "resumed.json").read_text())
    trained = {int(step): ids for step, ids in record["trained"].items()}
    assert trained_ids.mismatch(full[0], trained, 8) is None, trained_ids.mismatch(full[0], trained, 8)
    assert min(trained) == 9
    assert record["weights"] == full[1]
    stored = _stored(s3, f"{BUCKET}/run")
    assert sorted(stored) == ["checkpoint-16", "checkpoint-24", "checkpoint-32", "checkpoint-40", "checkpoint-8"]
    local = Path(record["staging"], "checkpoint-16")
    assert sorted(stored["checkpoint-16"]) == sorted(p.relative_to(local).as_posix() for p in local.rglob("*")
                                                     if p.is_file())  # fmt: skip


def test_the_bucket_holds_what_the_run_keeps_and_a_named_checkpoint_resumes_on_an_empty_disk(
    s3, server, tmp_path, monkeypatch, uninterrupted
):
    """save_total_limit=2 in the bucket and in the staging folder, the manifest of a rotated checkpoint removed
    before its other files; save_model() and save_metrics() stored when they return; a resume from
    ``s3://.../checkpoint-32`` on another staging folder trains the uninterrupted run's last 8 steps."""
    removed: list[str] = []
    remove_key = ObjectStorage._remove_key

    def recording(self, key):
        removed.append(key)
        rm = self.fs.rm
        self.fs.rm = lambda paths, *a, **k: (removed.append(paths), rm(paths, *a, **k))[1]
        try:
            return remove_key(self, key)
        finally:
            self.fs.rm = rm  # fsspec sets its sync methods on the instance: put back, not deleted

    monkeypatch.setattr(ObjectStorage, "_remove_key", recording)
    options = s3_server.options(server)
    trainer, _, _ = trained_ids.run(f"s3://{BUCKET}/run", trained_ids.source("map"), hflight, save_total_limit=2,
                                    storage_options=options)  # fmt: skip
    assert trainer.args.remote_output_dir == f"s3://{BUCKET}/run"
    assert trainer.args.output_dir == str(tmp_path / "staging" / "s3" / BUCKET / "run")
    stored = _stored(s3, f"{BUCKET}/run")
    assert sorted(stored) == ["checkpoint-32", "checkpoint-40"]
    assert sorted(p.name for p in Path(trainer.args.output_dir).glob("checkpoint-*")) == sorted(stored)
    rotated = f"{BUCKET}/run/checkpoint-8"
    first = len(removed) - 1 - removed[::-1].index(rotated)  # the rotation (the upload cleared the key first)
    manifest_first, the_rest = removed[first + 1], removed[first + 2]
    assert manifest_first == [f"{rotated}/checkpoint_manifest.json"] and f"{rotated}/model.safetensors" in the_rest
    trainer.save_model()
    trainer.save_metrics("train", {"train_loss": 1.0})
    s3.invalidate_cache()
    top = {p.rsplit("/", 1)[1] for p in s3.ls(f"{BUCKET}/run", detail=False)}
    assert {"model.safetensors", "config.json", "train_results.json", "all_results.json"} <= top

    monkeypatch.setenv("HFLIGHT_STAGING_DIR", str(tmp_path / "another-machine"))
    resumed, trained, _ = trained_ids.run(f"s3://{BUCKET}/run", trained_ids.source("map"), hflight,
                                          resume=f"s3://{BUCKET}/run/checkpoint-32", save_total_limit=2,
                                          storage_options=options)  # fmt: skip
    assert trained_ids.mismatch(uninterrupted[0], trained, 32) is None
    assert _digest(resumed.model) == uninterrupted[1]


def _torchrun_job(name: str, tmp_path: Path, server: str, url: str, staging: str, *options: str) -> launch.Job:
    """tests/jobs/remote_job.py under ``torchrun --nproc_per_node=2`` (``--fsdp``: FSDP2's sharded checkpoints)."""
    env = launch.environment(**s3_server.CREDENTIALS, AWS_ENDPOINT_URL=server)
    return launch.Job([*launch.torchrun(2), JOBS / "remote_job.py", tmp_path / name, "--url", url, "--staging",
                       tmp_path / staging, *options], tmp_path, env, console=tmp_path / f"{name}.txt",
                      timeout=420, name=name)  # fmt: skip


def _records(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads((tmp_path / f"{name}.rank{rank}").read_text()) for rank in range(2)]


def _uploads(tmp_path: Path, name: str, rank: int) -> list[str]:
    return (tmp_path / f"{name}.uploads{rank}").read_text().split()


@launch.needs_torchrun
def test_under_torchrun_each_process_uploads_its_shards_and_a_kill_mid_upload_resumes_on_an_empty_disk(
    s3, server, tmp_path
):
    """FSDP2 on 2 processes, sharded checkpoints: each process uploads the shards and the RNG state it wrote, process 0
    the rest and, once process 1's answer is in, the manifest. Process 1 SIGKILLed while it uploads checkpoint-16's
    shards: process 0 writes no manifest for it. A torchrun on another, empty staging folder resumes from
    checkpoint-8 (downloaded once for both processes) and trains, on each process, the uninterrupted run's examples
    step for step, ending on its weights. Beside them, DDP with save_async: process 1 uploads its RNG state from a
    thread of its own (the last checkpoint's too, whose write ends in a collective process 0 reaches after the
    upload), every checkpoint stored; and a run that fails while process 1 uploads checkpoint-8 stores it before its
    processes exit, as one process does."""
    full = _torchrun_job("full", tmp_path, server, f"s3://{BUCKET}/full", "machine0", "--fsdp")
    killed = _torchrun_job("killed", tmp_path, server, f"s3://{BUCKET}/run", "machine1", "--fsdp", "--kill-at-upload",
                           "16", "--kill-rank", "1")  # fmt: skip
    ddp_async = _torchrun_job("ddp_async", tmp_path, server, f"s3://{BUCKET}/ddp", "machine3", "--save-async")
    crashed = _torchrun_job("crashed", tmp_path, server, f"s3://{BUCKET}/crashed", "machine4", "--save-async",
                            "--crash-at", "10", "--slow-put-rank", "1")  # fmt: skip
    full.ok()
    # training fails at step 10 while process 1 still uploads checkpoint-8: both processes finish that upload first
    ended = crashed.wait()
    assert ended.returncode != 0 and "Finishing the checkpoint upload in flight to s3://" in ended.output
    assert "checkpoint_manifest.json" in _stored(s3, f"{BUCKET}/crashed")["checkpoint-8"]
    assert "storing it in" not in ddp_async.ok().output
    stored = _stored(s3, f"{BUCKET}/ddp")
    assert all("checkpoint_manifest.json" in stored[f"checkpoint-{step}"] for step in (8, 16, 24, 32, 40)), stored
    assert sorted(_uploads(tmp_path, "ddp_async", 1)) == sorted(f"{BUCKET}/ddp/checkpoint-{step}/rng_state_1.pth"
                                                                for step in (8, 16, 24, 32, 40))  # fmt: skip
    ended = killed.wait()
    assert ended.returncode != 0 and "Signal 9 (SIGKILL) received by PID" in ended.output, ended.tail()
    stored = _stored(s3, f"{BUCKET}/full")
    shards = {f"{part}/__{rank}_0.distcp" for part in ("pytorch_model_fsdp_0", "optimizer_0") for rank in (0, 1)}
    assert shards | {"rng_state_0.pth", "rng_state_1.pth", "checkpoint_manifest.json"} <= set(stored["checkpoint-40"])
    last = set(stored["checkpoint-40"])
    theirs = {name for name in last if "__1_" in name or name == "rng_state_1.pth"}
    uploaded = [[p.split("/checkpoint-40/")[1] for p in _uploads(tmp_path, "full", r) if "/checkpoint-40/" in p]
                for r in range(2)]  # fmt: skip
    assert sorted(uploaded[1]) == sorted(theirs) and sorted(uploaded[0]) == sorted(last - theirs)
    assert uploaded[0][-1] == "checkpoint_manifest.json"  # last, once process 1 answered

    stored = _stored(s3, f"{BUCKET}/run")
    assert "checkpoint_manifest.json" in stored["checkpoint-8"]
    assert "checkpoint_manifest.json" not in stored["checkpoint-16"], stored["checkpoint-16"]

    _torchrun_job("resumed", tmp_path, server, f"s3://{BUCKET}/run", "machine2", "--fsdp", "--resume", "true").ok()
    reference = _records(tmp_path, "full")
    for rank, record in enumerate(_records(tmp_path, "resumed")):
        trained = {int(step): ids for step, ids in record["trained"].items()}
        expected = {int(step): ids for step, ids in reference[rank]["trained"].items()}
        assert min(trained) == 9 and trained_ids.mismatch(expected, trained, 8) is None, (rank, trained)
        assert record["weights"] == reference[rank]["weights"]
    assert "checkpoint_manifest.json" in _stored(s3, f"{BUCKET}/run")["checkpoint-16"]


class _RequeueSignalAt(transformers.TrainerCallback):
    """SIGUSR1 (SLURM's requeue signal, ``--signal=USR1@90``) to this process during optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)


def test_a_slurm_requeue_continues_on_a_fresh_node_from_the_bucket(s3, server, tmp_path, monkeypatch, uninterrupted):
    """A SLURM task (srun's variables, the stand-in scontrol) requeued by SIGUSR1 during step 13: checkpoint-13 is in
    the bucket when the stop is reported and ``scontrol requeue`` runs; the requeued job on another node (an empty
    staging folder, ``SLURM_RESTART_COUNT=1``) resumes "auto" from the bucket and trains the uninterrupted run's
    examples from step 14 on, ending on its weights."""
    from hflight.run.interrupt import TrainingInterrupted

    from .cluster_runs import requeues, slurm_task

    log = slurm_task(monkeypatch, tmp_path)
    monkeypatch.setenv("HFLIGHT_STAGING_DIR", str(tmp_path / "node1"))
    url, options = f"s3://{BUCKET}/14242", s3_server.options(server)
    with pytest.raises(TrainingInterrupted) as stopped:
        trained_ids.run(url, trained_ids.source("map"), hflight, callbacks=[_RequeueSignalAt(13)],
                        storage_options=options)  # fmt: skip
    assert stopped.value.code == 138 and stopped.value.global_step == 13
    assert requeues(log) == [["requeue", "4242"]]
    assert "checkpoint_manifest.json" in _stored(s3, f"{BUCKET}/14242")["checkpoint-13"]

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv("HFLIGHT_STAGING_DIR", str(tmp_path / "node2"))
    resumed, trained, _ = trained_ids.run(url, trained_ids.source("map"), hflight, resume="auto",
                                          storage_options=options)  # fmt: skip
    assert min(trained) == 14 and trained_ids.mismatch(uninterrupted[0], trained, 13) is None
    assert _digest(resumed.model) == uninterrupted[1]
    assert requeues(log) == [["requeue", "4242"]]


# ---- faults ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("run", ["run", ""], ids=["a run folder", "the bucket's root"])
def test_multipart_uploads_a_killed_run_left_are_aborted_when_the_next_starts(s3, server, tmp_path, caplog, run):
    """A process killed mid-upload of a large file leaves an unfinished multipart upload (no object; its parts kept and
    billed): the run's start aborts those of its own checkpoints, never another run's or another tool's (beside it, or
    inside its prefix: a run at the bucket's root)."""
    prefix = f"{run}/" if run else ""
    own = [f"{prefix}checkpoint-8/model.safetensors", f"{prefix}checkpoint-16/optimizer_0/__1_0.distcp"]
    others = ["run2/checkpoint-8/model.safetensors", f"{prefix}other/checkpoint-16/model.safetensors",
              f"{prefix}run-7/checkpoint-3/model.safetensors", f"{prefix}dataset.tar"]  # fmt: skip
    for key in own + others:
        upload = s3.call_s3("create_multipart_upload", Bucket=BUCKET, Key=key)
        s3.call_s3("upload_part", Bucket=BUCKET, Key=key, UploadId=upload["UploadId"], PartNumber=1,
                   Body=b"x" * 1024)  # fmt: skip
    url = f"s3://{BUCKET}/{run}".rstrip("/")
    with caplog.at_level(logging.WARNING):
        ObjectStorage(url, str(tmp_path / "staging"), s3_server.options(server)).probe()
    left = s3.call_s3("list_multipart_uploads", Bucket=BUCKET).get("Uploads", [])
    assert sorted(upload["Key"] for upload in left) == sorted(others)
    assert f"Aborted 2 unfinished multipart upload(s) under {url}" in caplog.text


def test_a_second_storage_of_the_same_url_never_reuses_a_checkpoint_round():
    """The processes' words about a checkpoint's upload are keyed by its round: a second Trainer writing the same URL
    (from another staging folder, or with other options) must not find the first one's "go" and "ok" there."""
    first, second = (ObjectStorage("memory://hflight-rounds/run", staging) for staging in ("/tmp/a", "/tmp/b"))
    rounds = [first.round(), first.round(), second.round(), first.round()]
    assert len(set(rounds)) == 4, rounds


def test_server_errors_are_retried_and_training_goes_on(s3, server, caplog):
    """The server answers 503 to six uploads in a row: each is retried (botocore's attempts, then hflight's with
    backoff), every checkpoint is stored, nothing is said to be missing."""
    proxy = s3_server.FaultProxy(server)
    try:
        proxy.fail("PUT", 6)
        with caplog.at_level(logging.WARNING):
            trainer, _, _ = trained_ids.run(f"s3://{BUCKET}/run", trained_ids.source("map"), hflight, max_steps=16,
                                            storage_options=s3_server.options(proxy.endpoint, attempts=2))  # fmt: skip
    finally:
        proxy.close()
    assert proxy.refused["PUT"] == 6
    stored = _stored(s3, f"{BUCKET}/run")
    assert all("checkpoint_manifest.json" in stored[name] for name in ("checkpoint-8", "checkpoint-16"))
    assert not [r for r in caplog.records if "failed" in r.getMessage() or "Not stored" in r.getMessage()]


class _AtSave(transformers.TrainerCallback):
    def __init__(self, step: int, seen) -> None:
        self.step, self.seen, self.said = step, seen, None

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.said = self.seen()


def test_with_save_async_the_next_checkpoint_does_not_wait_for_the_previous_upload(s3, server):
    """checkpoint-8's upload held at the server: the run saves checkpoint-16 (locally) while it is held, and every
    checkpoint is stored once it is let go; the run's last checkpoint is in the bucket when train() returns."""
    proxy = s3_server.FaultProxy(server)
    proxy.hold("PUT", "/run/checkpoint-8/")

    def seen():
        deadline = time.monotonic() + 20
        while not proxy.holding and time.monotonic() < deadline:  # the upload thread reaches its first file
            time.sleep(0.05)
        s3.invalidate_cache()
        return proxy.holding, s3.exists(f"{BUCKET}/run/checkpoint-8/checkpoint_manifest.json"), proxy.release()

    at_16 = _AtSave(16, seen)
    try:
        trained_ids.run(f"s3://{BUCKET}/run", trained_ids.source("map"), hflight, max_steps=24, save_async=True,
                        callbacks=[at_16], storage_options=s3_server.options(proxy.endpoint))  # fmt: skip
    finally:
        proxy.release()
        proxy.close()
    held, stored_8, _ = at_16.said
    assert held >= 1 and not stored_8  # checkpoint 16 saved while 8's upload was held
    stored = _stored(s3, f"{BUCKET}/run")
    assert all("checkpoint_manifest.json" in stored[f"checkpoint-{step}"] for step in (8, 16, 24))


class _ServerGoesAway(transformers.TrainerCallback):
    def __init__(self, proxy, down_at: int, back_at: int | None) -> None:
        self.proxy, self.down_at, self.back_at = proxy, down_at, back_at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.down_at:
            self.proxy.down = True
        if state.global_step == self.back_at:
            self.proxy.down = False


@pytest.mark.parametrize("back_at", [30, None], ids=["back before the end", "gone to the end"])
def test_a_server_gone_mid_run_keeps_the_local_checkpoints_and_says_what_is_not_stored(
    s3, server, caplog, monkeypatch, back_at
):
    """The server answers 500 to everything from step 12: checkpoints 16 and 24 fail to upload, each warned once,
    and their local copies are kept although save_total_limit=1. Back at step 30: both go up before checkpoint 32
    (then rotated away in the bucket as in the staging folder). Gone to the end: train() ends saying which are not
    stored (the last one among them), and every one of them is still on the local disk."""
    monkeypatch.setattr(objects, "BACKOFF_S", 0.05)  # hflight's own retries, quick (s3fs's own still wait)
    proxy = s3_server.FaultProxy(server)
    try:
        with caplog.at_level(logging.WARNING):
            trainer, _, _ = trained_ids.run(f"s3://{BUCKET}/run", trained_ids.source("map"), hflight,
                                            save_total_limit=1, callbacks=[_ServerGoesAway(proxy, 12, back_at)],
                                            storage_options=s3_server.options(proxy.endpoint, attempts=1))  # fmt: skip
    finally:
        proxy.close()
    staging = Path(trainer.args.output_dir)
    failed = [r.getMessage() for r in caplog.records if "is saved locally, but storing it in" in r.getMessage()]
    stored = _stored(s3, f"{BUCKET}/run")
    local = sorted(p.name for p in staging.glob("checkpoint-*"))
    if back_at is not None:
        assert [m.split(" is saved")[0].rsplit("/", 1)[1] for m in failed] == ["checkpoint-16", "checkpoint-24"]
        assert sorted(stored) == ["checkpoint-40"] and local == ["checkpoint-40"]
        assert not [r for r in caplog.records if "Not stored in" in r.getMessage()]
    else:
        assert [m.split(" is saved")[0].rsplit("/", 1)[1] for m in failed] == [
            "checkpoint-16", "checkpoint-24", "checkpoint-32", "checkpoint-40"]  # fmt: skip
        assert sorted(stored) == ["checkpoint-8"]
        assert local == ["checkpoint-16", "checkpoint-24", "checkpoint-32", "checkpoint-40"]  # 8: stored, rotated
        said = [r.getMessage() for r in caplog.records if "Not stored in" in r.getMessage()]
        assert len(said) == 1 and str(staging / "checkpoint-40") in said[0]


def _never_trains(*args, **kwargs):
    raise AssertionError("a step ran")


@pytest.mark.parametrize("case", ["no bucket", "no server", "wrong credentials", "no filesystem"])
def test_a_url_that_cannot_take_checkpoints_is_refused_before_the_first_step(s3, server, tmp_path, case):
    """The probe write names the URL and the cause (the bucket, the endpoint, the credentials, the package to
    install) before the model trains a step."""
    options = s3_server.options(server)
    url = f"s3://{BUCKET}/run"
    missing = next(p for p in ("oss", "gs", "az", "oci", "box") if _absent(known_implementations[p]))
    expected = {"no bucket": "bucket does not exist", "no server": "Could not connect",
                "wrong credentials": "Access Key Id you provided does not exist",
                "no filesystem": "is not installed"}[case]  # fmt: skip
    if case == "no bucket":
        url = "s3://no-such-bucket/run"
    elif case == "no server":
        options = s3_server.options(f"http://127.0.0.1:{s3_server.free_port()}", attempts=1)
    elif case == "no filesystem":
        url, options = f"{missing}://bucket/run", None
    if case == "wrong credentials":
        with s3_server.moto_server(tmp_path / "auth.log", check_credentials=True) as checking:
            error = _refusal(url, s3_server.options(checking))
    else:
        error = _refusal(url, options)
    assert url in str(error) and expected in str(error), str(error)
    assert not any(Path(tmp_path / "staging").rglob("checkpoint-*"))


def _absent(implementation: dict) -> bool:
    return importlib.util.find_spec(implementation["class"].split(".")[0]) is None


def _refusal(url: str, options: dict | None) -> BaseException:
    dataset = trained_ids.source("map")
    trainer_class = trained_ids.spying(hflight)
    args = hflight.TrainingArguments(**trained_ids.arguments(url, storage_options=options))
    trainer = trainer_class(trained_ids.model(), args, train_dataset=dataset)
    trainer.compute_loss = _never_trains
    with pytest.raises(StorageError) as refused:
        trainer.train()
    assert trainer.state.global_step == 0
    return refused.value


def test_a_crafted_or_damaged_stored_checkpoint_is_refused_as_a_local_one(s3, server, tmp_path, monkeypatch):
    """A stored object whose key climbs out of the checkpoint (``../``) is refused before anything is written; a
    stored file that differs from its manifest's checksum is refused by the resume's checks, naming the file."""
    options = s3_server.options(server)
    trained_ids.run(f"s3://{BUCKET}/run", trained_ids.source("map"), hflight, max_steps=8, storage_options=options)
    s3.pipe_file(f"{BUCKET}/run/checkpoint-8/../escape.txt", b"outside")  # a key S3 takes as it is
    monkeypatch.setenv("HFLIGHT_STAGING_DIR", str(tmp_path / "fresh"))
    with pytest.raises(hflight.UnsafeCheckpointFile, match="outside the checkpoint folder"):
        trained_ids.run(f"s3://{BUCKET}/run", trained_ids.source("map"), hflight, max_steps=16, resume=True,
                        storage_options=options)  # fmt: skip
    assert not list((tmp_path / "fresh").rglob("escape.txt"))
    s3.rm_file(f"{BUCKET}/run/checkpoint-8/../escape.txt")
    scheduler = s3.cat_file(f"{BUCKET}/run/checkpoint-8/scheduler.pt")
    s3.pipe_file(f"{BUCKET}/run/checkpoint-8/scheduler.pt", scheduler[:-1] + bytes([scheduler[-1] ^ 1]))
    monkeypatch.setenv("HFLIGHT_STAGING_DIR", str(tmp_path / "fresh2"))
    with pytest.raises(hflight.IncompleteCheckpointError, match="scheduler.pt"):
        trained_ids.run(f"s3://{BUCKET}/run", trained_ids.source("map"), hflight, max_steps=16, resume=True,
                        storage_options=options)  # fmt: skip


# ---- found by the fault read ----------------------------------------------------------------------------------------
class _StopAt(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = control.should_training_stop = True


def test_a_resume_on_a_new_machine_keeps_the_best_checkpoint_in_the_bucket_and_loads_it(s3, server, monkeypatch):
    """load_best_model_at_end with save_total_limit=2: the best checkpoint (an early one) recorded by the stopped run
    is downloaded by the resume on an empty disk, protected from rotation in the bucket, and loaded at the end."""
    from safetensors.torch import load

    options = s3_server.options(server)
    best = dict(
        eval_dataset="train",
        eval_strategy="steps",
        eval_steps=8,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,
        save_total_limit=2,
    )  # an early checkpoint best
    trained_ids.run(f"s3://{BUCKET}/run", trained_ids.source("map"), hflight, storage_options=options,
                    callbacks=[_StopAt(24)], **best)  # fmt: skip
    recorded = json.loads(s3.cat_file(f"{BUCKET}/run/checkpoint-24/trainer_state.json"))["best_model_checkpoint"]
    name = os.path.basename(recorded)
    monkeypatch.setenv("HFLIGHT_STAGING_DIR", str(Path(os.environ["HFLIGHT_STAGING_DIR"]) / "another-machine"))
    trainer, _, _ = trained_ids.run(f"s3://{BUCKET}/run", trained_ids.source("map"), hflight, storage_options=options,
                                    resume=True, **best)  # fmt: skip
    assert os.path.basename(trainer.state.best_model_checkpoint) == name
    assert name in _stored(s3, f"{BUCKET}/run")
    weights = load(s3.cat_file(f"{BUCKET}/run/{name}/model.safetensors"))
    model = trainer.model.state_dict()
    assert all(torch.equal(model[key], value) for key, value in weights.items())


def test_local_checkpoints_the_store_lacks_are_resumed_from_and_uploaded(s3, server, monkeypatch):
    """The store fails after checkpoint 8: 16 and 24 stay in the staging folder. Run again once it answers, with
    resume_from_checkpoint=True: the run resumes from the local checkpoint-24 (as transformers would from its folder)
    and uploads it, before its own checkpoints."""
    monkeypatch.setattr(objects, "BACKOFF_S", 0.01)
    proxy = s3_server.FaultProxy(server)

    class Down(transformers.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            proxy.down = proxy.down or state.global_step == 8

    try:
        trained_ids.run(f"s3://{BUCKET}/run", trained_ids.source("map"), hflight, max_steps=24, callbacks=[Down()],
                        storage_options=s3_server.options(proxy.endpoint, attempts=1))  # fmt: skip
    finally:
        proxy.close()
    assert sorted(_stored(s3, f"{BUCKET}/run")) == ["checkpoint-8"]
    _, trained, _ = trained_ids.run(f"s3://{BUCKET}/run", trained_ids.source("map"), hflight, max_steps=32,
                                    resume=True, storage_options=s3_server.options(server))  # fmt: skip
    assert min(trained) == 25
    stored = _stored(s3, f"{BUCKET}/run")
    assert all("checkpoint_manifest.json" in stored[f"checkpoint-{step}"] for step in (8, 16, 24, 32))


def test_a_damaged_local_copy_is_replaced_by_the_stored_one_and_a_url_resumes_into_a_local_folder(s3, server, tmp_path):
    """A local copy whose manifest matches the bucket's but whose file is damaged is downloaded again (checksums,
    not only sizes); ``resume_from_checkpoint=URL`` with a local output_dir takes its storage_options."""
    options = s3_server.options(server)
    trainer, _, _ = trained_ids.run(f"s3://{BUCKET}/run", trained_ids.source("map"), hflight, max_steps=16,
                                    storage_options=options)  # fmt: skip
    scheduler = Path(trainer.args.output_dir, "checkpoint-16", "scheduler.pt")
    data = bytearray(scheduler.read_bytes())
    data[-1] ^= 1
    scheduler.write_bytes(bytes(data))
    _, trained, _ = trained_ids.run(f"s3://{BUCKET}/run", trained_ids.source("map"), hflight, max_steps=24,
                                    resume=True, storage_options=options)  # fmt: skip
    assert min(trained) == 17
    _, trained, _ = trained_ids.run(tmp_path / "local", trained_ids.source("map"), hflight, max_steps=24,
                                    resume=f"s3://{BUCKET}/run/checkpoint-8", storage_options=options)  # fmt: skip
    assert min(trained) == 9


def test_a_store_that_never_answers_fails_the_upload_and_training_goes_on(s3, server, monkeypatch, caplog):
    """Requests accepted and never answered from checkpoint 16 on: each upload gives up after its deadline (fsspec's
    timeout; 1 s here, 60 s plus the transfer at 2 MB/s by default), is warned once, and training goes on to the end;
    partial copies older than the newest stored checkpoint are removed by the next rotation."""
    monkeypatch.setattr(objects, "CALL_TIMEOUT_S", 1.0)
    s3.pipe_file(f"{BUCKET}/run/checkpoint-4/model.safetensors", b"left by a process killed mid-upload")
    proxy = s3_server.FaultProxy(server)

    class Stall(transformers.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 8:
                proxy.hold("PUT", "/run/", limit_s=60)

    try:
        with caplog.at_level(logging.WARNING):
            trainer, trained, _ = trained_ids.run(f"s3://{BUCKET}/run", trained_ids.source("map"), hflight,
                                                  max_steps=24, callbacks=[Stall()],
                                                  storage_options=s3_server.options(proxy.endpoint))  # fmt: skip
    finally:
        proxy.release()
        proxy.close()
    assert max(trained) == 24
    failed = [r.getMessage() for r in caplog.records if "is saved locally, but storing it in" in r.getMessage()]
    assert len(failed) == 2 and "Timeout" in failed[0], failed  # checkpoints 16 and 24, once each
    assert not [r for r in caplog.records if "removing older checkpoints" in r.getMessage()]
    stored = _stored(s3, f"{BUCKET}/run")
    assert "checkpoint-4" not in stored and "checkpoint_manifest.json" in stored["checkpoint-8"]


def test_storage_options_are_hidden_where_the_arguments_are_shown(tmp_path, monkeypatch):
    monkeypatch.setenv("HFLIGHT_STAGING_DIR", str(tmp_path))
    secret = {"key": "AKIA-hflight", "secret": "s3cr3t-hflight"}
    args = hflight.TrainingArguments(output_dir="s3://bucket/run", storage_options=secret)
    for shown in (str(args), repr(args), json.dumps(args.to_dict()), args.to_json_string()):
        assert "s3cr3t-hflight" not in shown and "AKIA-hflight" not in shown
    assert args.storage_options == secret


# ---- the command line ---------------------------------------------------------------------------------------------
def test_the_command_line_trains_into_the_bucket_and_resumes_from_it(s3, server, tmp_path, monkeypatch, command_line):
    """``hflight-train +experiment=mrc args.output_dir=s3://bucket/mrc`` with the endpoint in AWS_ENDPOINT_URL: the
    checkpoints, the model and the results files in the bucket; ``resume=auto`` on an empty staging folder continues
    from the bucket's last checkpoint."""
    from .support import TINY

    monkeypatch.setenv("AWS_ENDPOINT_URL", server)
    monkeypatch.chdir(tmp_path)
    url = f"s3://{BUCKET}/mrc"
    assert command_line(*TINY, f"args.output_dir={url}", f"hydra.run.dir={tmp_path / 'run1'}") == 0
    names = {p.rsplit("/", 1)[1] for p in s3.find(f"{BUCKET}/mrc")}
    assert {"all_results.json", "model.safetensors", "eval_predictions.json", "checkpoint_manifest.json"} <= names
    assert not [name for name in names if name.startswith(".")]  # no lock or probe objects
    first = json.loads(s3.cat_file(f"{BUCKET}/mrc/trainer_state.json"))["global_step"]
    monkeypatch.setenv("HFLIGHT_STAGING_DIR", str(tmp_path / "empty"))
    code = command_line(*[o for o in TINY if not o.startswith("args.num_train_epochs")], "args.num_train_epochs=3",
                        f"args.output_dir={url}", "args.resume_from_checkpoint=auto",
                        f"hydra.run.dir={tmp_path / 'run2'}")  # fmt: skip
    assert code == 0
    said = [line for line in (tmp_path / "run2" / "mrc.log").read_text().splitlines() if "resuming from" in line]
    assert said and f"checkpoint-{first}, the last valid checkpoint of {url}" in said[0], said
    assert json.loads(s3.cat_file(f"{BUCKET}/mrc/trainer_state.json"))["global_step"] == first * 3 // 2


# ---- the arguments -----------------------------------------------------------------------------------------------
def test_the_url_becomes_remote_output_dir_and_output_dir_its_staging_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HFLIGHT_STAGING_DIR", str(tmp_path))
    args = hflight.TrainingArguments(output_dir="s3://bucket/run/", storage_options='{"anon": false}')
    assert (args.remote_output_dir, args.output_dir) == (
        "s3://bucket/run/".rstrip("/"),
        str(tmp_path / "s3/bucket/run"),
    )
    assert args.storage_options == {"anon": False}
    chosen = hflight.TrainingArguments(output_dir=str(tmp_path / "mine"), remote_output_dir="gs://b/r")
    assert (chosen.remote_output_dir, chosen.output_dir) == ("gs://b/r", str(tmp_path / "mine"))
    assert hflight.TrainingArguments(output_dir=f"file://{tmp_path}/x").output_dir == f"{tmp_path}/x"
    refused = {
        "name two places": dict(output_dir="s3://a/r", remote_output_dir="s3://b/r"),
        "is not the URL of an object store": dict(output_dir="x", remote_output_dir="/local/folder"),
        "'..' parts": dict(output_dir="s3://bucket/a/../run"),
        "save_on_each_node=True": dict(output_dir="s3://a/r", save_on_each_node=True),
    }
    for message, values in refused.items():
        with pytest.raises(ValueError, match=message):
            hflight.TrainingArguments(**values)
