"""One side of the field sweep's comparison in several processes (``tests/test_field_sweep.py``: fsdp, fsdp_config,
deepspeed), as users launch it: ``torchrun --nproc_per_node=2 tests/jobs/field_job.py LIBRARY OUT FIELDS RESULT``. Every
process runs the sweep's train/evaluate/predict (``tests/field_runs.py``'s ``run_field``) with ``LIBRARY``'s Trainer and
the fields of the JSON object ``FIELDS``; global rank 0 pickles what the sides are compared on into ``RESULT``."""

import json
import os
import pickle
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.* as the sweep imports them

from tests.field_runs import run_field  # noqa: E402


def main() -> int:
    library, out, fields, result = sys.argv[1:5]
    observed = run_field(library, out, json.loads(fields))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(result, "wb") as handle:
            pickle.dump(observed, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
