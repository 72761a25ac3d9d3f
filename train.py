"""Train with hflight from the Hydra config tree in ./conf:  python train.py +experiment=mrc [key=value ...]

The same command is installed as ``hflight-train`` and runs as ``python -m hflight``; the work is in ``hflight.cli``.
This script reads the ``conf/`` beside it (unless ``HFLIGHT_CONFIG_DIR`` names another tree).
"""

import os
from pathlib import Path

os.environ.setdefault("HFLIGHT_CONFIG_DIR", str(Path(__file__).resolve().parent / "conf"))

from hflight.cli import main  # noqa: E402 - after the config tree is chosen

if __name__ == "__main__":
    main()
