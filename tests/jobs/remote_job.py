"""A run of the trained-examples script (``trained_ids``) whose ``output_dir`` is an S3 URL (issue 68), in a process of
its own so that it can be SIGKILLed mid-upload:

    python remote_job.py RECORD --url s3://bucket/run --staging DIR [--resume true|URL] [--kill-at-upload N]
        [--save-async] [--save-total-limit K]
    torchrun --nproc_per_node=2 remote_job.py RECORD --url ... --staging DIR --fsdp [--kill-rank R] ...

The endpoint and credentials come from the environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), as a
user's job reads them. ``--kill-at-upload N``: the process (``--kill-rank``'s, under torchrun) SIGKILLs itself in the
upload of ``checkpoint-N``, once one of its files is in the bucket (s3fs's ``_put_file`` wrapped: test code, the
product never sees it); every file each process uploads is listed in ``RECORD.uploads<rank>``; ``--slow-put-rank R``:
process R's uploads take 2 s a file longer; ``--crash-at N``: training fails (an exception) as step N begins.
``--fsdp``: FSDP2, sharded checkpoints (each process writes its own shards). RECORD (``RECORD.rank<R>`` under
torchrun) gets the ids each step trained on that process and the final weights' checksum (the whole parameters,
gathered from the shards)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trained_ids  # noqa: E402


def _watch_uploads(listed: Path, step: int | None, slow_s: float = 0.0) -> None:
    """Every file this process uploads appended to ``listed``; ``step``: SIGKILL in the upload of checkpoint-``step``,
    once one of its files is in the bucket; ``slow_s``: each file's upload takes that much longer."""
    import asyncio

    import s3fs

    put_file = s3fs.S3FileSystem._put_file

    async def watching(self, lpath, rpath, *args, **kwargs):
        await asyncio.sleep(slow_s)
        result = await put_file(self, lpath, rpath, *args, **kwargs)
        with listed.open("a") as handle:
            handle.write(f"{rpath}\n")
        if step is not None and f"/checkpoint-{step}/" in rpath and not rpath.endswith("checkpoint_manifest.json"):
            os.kill(os.getpid(), signal.SIGKILL)  # the first of its files is in the bucket, the others may not be
        return result

    s3fs.S3FileSystem._put_file = watching


class _CrashAt:
    """Training fails (an exception on every process) as optimizer step ``step`` begins."""

    def __new__(cls, step: int):
        import transformers

        class CrashAt(transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step + 1 == step:
                    raise RuntimeError(f"training fails at step {step}")

        return CrashAt()


def _digest(model) -> str:
    """The whole parameters' checksum (every process of a sharded model gathers each, in the same order)."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        digest.update(name.encode())
        digest.update(whole.detach().to(torch.float32).numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("record")
    parser.add_argument("--url", required=True)
    parser.add_argument("--staging", required=True)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--kill-at-upload", type=int, default=None)
    parser.add_argument("--save-async", action="store_true")
    parser.add_argument("--save-total-limit", type=int, default=None)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--slow-put-rank", type=int, default=None)
    parser.add_argument("--crash-at", type=int, default=None)
    options = parser.parse_args()
    os.environ["HFLIGHT_STAGING_DIR"] = options.staging
    rank = int(os.environ.get("RANK", 0))
    record = options.record + (f".rank{rank}" if "RANK" in os.environ else "")
    kill = options.kill_at_upload if rank == options.kill_rank else None
    _watch_uploads(Path(f"{options.record}.uploads{rank}"), kill, 2.0 if options.slow_put_rank == rank else 0.0)
    import torch

    import hflight

    torch.set_num_threads(1)
    sharding = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 2, "state_dict_type": "SHARDED_STATE_DICT",
                "transformer_layer_cls_to_wrap": ["BertLayer"]}} if options.fsdp else {}  # fmt: skip
    resume = {"true": True, None: None}.get(options.resume, options.resume)
    callbacks = [_CrashAt(options.crash_at)] if options.crash_at else []
    trainer, trained, _ = trained_ids.run(options.url, trained_ids.source("map"), hflight, resume=resume,
                                          save_async=options.save_async, callbacks=callbacks,
                                          save_total_limit=options.save_total_limit, **sharding)  # fmt: skip
    Path(record).write_text(json.dumps({
        "trained": {str(step): ids for step, ids in trained.items()},
        "weights": _digest(trainer.model),
        "staging": trainer.args.output_dir,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
