"""CI's build of ORTModule's two CPU extensions (``bash .ci/ortmodule-env`` with ``ORTMODULE_EXTENSIONS_QUICK=1``).

``python -m torch_ort.configure`` runs each extension's ``setup.py build`` in onnxruntime's package folder and copies
the libraries it built next to it. This builds the same two libraries from the same sources with the same torch
extension machinery, into the same place, with two differences that only cost less to compile:

- ``-O0`` in place of the ``-O3`` that torch_interop_utils' setup.py asks for;
- torch_interop_utils' five source files (the list its setup.py holds, read from there) compiled as one translation
  unit, which ``#include``s them in that order: ``torch/extension.h`` and pybind11 are parsed once, not five times
  (about 30 CPU-seconds each here). The five files share no file-level names.

The extensions run only ORTModule's fallbacks to torch (custom autograd functions, ATen ops), a few calls in the tests,
so their speed does not matter there; what they do is unchanged. Run with the ORTModule environment's Python.
"""

from __future__ import annotations

import ast
import glob
import os
import shutil
import sys
import tempfile

from onnxruntime.training import ortmodule
from setuptools import setup
from torch.utils import cpp_extension


def _sources(setup_py: str) -> list[str]:
    """The ``source_filenames`` list of an extension's setup.py, read without running it."""
    with open(setup_py, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "source_filenames" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit(f"{setup_py}: no source_filenames list (another onnxruntime-training than 1.19.2?)")


def main() -> None:
    root = ortmodule.ORTMODULE_TORCH_CPP_DIR
    interop = os.path.join(root, "cpu", "torch_interop_utils")
    aten = os.path.join(root, "cpu", "aten_op_executor", "aten_op_executor.cc")
    work = tempfile.mkdtemp(prefix="ortmodule-extensions-")
    unity = os.path.join(work, "torch_interop_utils_unity.cc")
    with open(unity, "w", encoding="utf-8") as handle:
        handle.writelines(f'#include "{os.path.join(interop, name)}"\n' for name in _sources(interop + "/setup.py"))
    quick = ["-O0", "-std=c++17"]
    setup(
        name="ortmodule-extensions",
        ext_modules=[
            cpp_extension.CppExtension(
                name="torch_interop_utils", sources=[unity], include_dirs=[interop], extra_compile_args={"cxx": quick}
            ),
            cpp_extension.CppExtension(name="aten_op_executor", sources=[aten], extra_compile_args={"cxx": quick}),
        ],
        cmdclass={"build_ext": cpp_extension.BuildExtension},
        script_args=["-q", "build_ext", "--build-temp", os.path.join(work, "temp"), "--build-lib", work],
    )
    built = glob.glob(os.path.join(work, "*.so"))
    if len(built) != 2:
        raise SystemExit(f"expected 2 libraries in {work}, found {built}")
    for library in built:
        shutil.copyfile(library, os.path.join(root, os.path.basename(library)))
        print(f"Installed {os.path.basename(library)} -> {root}")
    shutil.rmtree(work)


if __name__ == "__main__":
    sys.exit(main())
