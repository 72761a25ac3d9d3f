"""Train with hflight from the Hydra config tree in ./conf:  python train.py +experiment=mrc [key=value ...]

The same entry point is installed as the console script ``hflight-train``; the work is in ``hflight.cli``.
"""

import hydra
from omegaconf import DictConfig

from hflight import cli


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return cli.main(cfg)


if __name__ == "__main__":
    main()
