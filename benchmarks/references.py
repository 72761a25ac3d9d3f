"""The reference libraries the benchmarks compare hflight with, and how to install them: a benchmark checks before it
imports them, so that a missing one is named with its install command instead of an ImportError.

    from references import missing_references
    if missing_references():
        sys.exit("...: missing " + ", ".join(missing_references()))
"""

from __future__ import annotations

import importlib.util

#: library -> its install command (transformers.Trainer needs accelerate)
REFERENCES = {"transformers": "pip install 'transformers>=5.23,<5.24'", "accelerate": "pip install 'accelerate>=1.1'"}


def missing_references() -> list[str]:
    """The reference libraries that are not installed, each with its install command."""
    return [f"{name} ({command})" for name, command in REFERENCES.items() if importlib.util.find_spec(name) is None]
