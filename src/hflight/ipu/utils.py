"""``hflight.ipu.utils``: what optimum-graphcore's example scripts import from ``optimum.graphcore.utils``.

``check_min_version`` checks the optimum-graphcore API level ``hflight.ipu`` implements (:data:`API_VERSION`,
optimum-graphcore's last release) against the version a script asks for, with optimum-graphcore's error.
"""

from __future__ import annotations

from packaging import version

__all__ = ["API_VERSION", "check_min_version"]

#: The optimum-graphcore release whose API ``hflight.ipu`` follows (``IPUConfig``, ``IPUTrainer``,
#: ``IPUSeq2SeqTrainer`` and their arguments).
API_VERSION = "0.7.1"


def check_min_version(min_version: str) -> None:
    """Raise ``ImportError`` when a script needs a newer optimum-graphcore than :data:`API_VERSION` (a ``dev``
    version asks for a source install, as in optimum-graphcore)."""
    if version.parse(API_VERSION) < version.parse(min_version):
        if "dev" in min_version:
            message = "This example requires a source install from HuggingFace Optimum-Graphcore"
        else:
            message = f"This example requires a minimum version of {min_version},"
        message += f" but the version found is {API_VERSION} (the optimum-graphcore API of hflight.ipu).\n"
        raise ImportError(message)
