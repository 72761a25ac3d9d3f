"""A run of the trained-examples script (``trained_ids``) whose ``output_dir`` is an S3 URL (issue 68), in a process of
its own so that it can be SIGKILLed mid-upload:

    python remote_job.py RECORD --url s3://bucket/run --staging DIR [--resume true|URL] [--kill-at-upload N]
        [--save-async] [--save-total-limit K]

The endpoint and credentials come from the environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), as a
user's job reads them. ``--kill-at-upload N``: the process SIGKILLs itself in the upload of ``checkpoint-N``, once one
of its files is in the bucket (s3fs's ``_put_file`` wrapped: test code, the product never sees it). RECORD gets the ids
each step trained and the final weights' checksum."""

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


def _kill_in_upload(step: int) -> None:
    import s3fs

    put_file = s3fs.S3FileSystem._put_file
    uploaded = []

    async def killing(self, lpath, rpath, *args, **kwargs):
        if f"/checkpoint-{step}/" in rpath:
            if uploaded:
                os.kill(os.getpid(), signal.SIGKILL)
            result = await put_file(self, lpath, rpath, *args, **kwargs)
            uploaded.append(rpath)
            return result
        return await put_file(self, lpath, rpath, *args, **kwargs)

    s3fs.S3FileSystem._put_file = killing


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("record")
    parser.add_argument("--url", required=True)
    parser.add_argument("--staging", required=True)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--kill-at-upload", type=int, default=None)
    parser.add_argument("--save-async", action="store_true")
    parser.add_argument("--save-total-limit", type=int, default=None)
    options = parser.parse_args()
    os.environ["HFLIGHT_STAGING_DIR"] = options.staging
    if options.kill_at_upload is not None:
        _kill_in_upload(options.kill_at_upload)
    import torch

    import hflight

    resume = {"true": True, None: None}.get(options.resume, options.resume)
    trainer, trained, _ = trained_ids.run(options.url, trained_ids.source("map"), hflight, resume=resume,
                                          save_async=options.save_async,
                                          save_total_limit=options.save_total_limit)  # fmt: skip
    digest = hashlib.sha256()
    for name, tensor in sorted(trainer.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).numpy().tobytes())
    Path(options.record).write_text(json.dumps({
        "trained": {str(step): ids for step, ids in trained.items()},
        "weights": digest.hexdigest(),
        "staging": trainer.args.output_dir,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
