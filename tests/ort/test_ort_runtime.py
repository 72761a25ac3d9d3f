"""ORTModule's import (issue 24, point 7): an absent onnxruntime-training says what to install, a broken one says
what broke. Runs without onnxruntime: the installs are folders on the path of a child process."""

from __future__ import annotations

import pytest

# ---- ORTModule: not installed vs installed but broken ---------------------------------------------------------------
_ORTMODULE_PROBE = """
import sys
from hflight.ort import runtime
try:
    runtime.require_ortmodule()
except Exception as exc:
    print(type(exc).__name__, "|", exc)
print("auto:", runtime.ortmodule_class())
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("broken", [False, True])
def test_a_broken_ortmodule_install_reports_its_real_import_error(tmp_path, broken):
    """An onnxruntime-training whose ORTModule fails to import (here: a shared library it cannot load) is reported
    with that error, not as "not installed"; an absent one still says what to install."""
    import os
    import subprocess
    import sys

    package = tmp_path / "onnxruntime" / "training" / "ortmodule"
    if broken:
        package.mkdir(parents=True)
        for folder in (package.parent.parent, package.parent):
            (folder / "__init__.py").write_text("")
        (package / "__init__.py").write_text(
            "raise OSError('libonnxruntime_providers_cuda.so: cannot open shared object file')\n"
        )
    else:  # a package that shadows any real onnxruntime and has no training part
        (tmp_path / "onnxruntime").mkdir()
        (tmp_path / "onnxruntime" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _ORTMODULE_PROBE], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "auto: None" in done.stdout
    if broken:
        assert "ImportError | onnxruntime-training is installed, but ORTModule does not import" in done.stdout
        assert "OSError: libonnxruntime_providers_cuda.so: cannot open shared object file" in done.stdout
        assert "ORTModule does not import" in done.stderr  # the "auto" lookup warns with it too
    else:
        assert done.stdout.startswith("ModuleNotFoundError | ORTModule training needs onnxruntime-training")
