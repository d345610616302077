"""Modules of an older git revision, imported beside this checkout's: the "before" side of a
benchmark's before/after comparison (old kernels are compared against a revision, not kept as
frozen copies in the tree).

    mods = import_at("9247dbf", {"nvfp4": "ft/kernels/nvfp4_triton.py"})
    mods["nvfp4"].nvfp4_linear_triton(x, packed, scale, scale_2)
"""

from __future__ import annotations

import atexit
import importlib.util
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def exists_at(rev: str, path: str) -> bool:
    """Whether `path` (relative to the repository root) is a file or folder in revision `rev`."""
    return subprocess.run(["git", "cat-file", "-e", f"{rev}:{path}"], cwd=REPO, capture_output=True).returncode == 0


def import_at(rev: str, files: dict[str, str]) -> dict[str, ModuleType]:
    """{name: the module at files[name] in revision `rev`}, each imported by path.

    The revision's `ft` and the other top-level folders of `files` are extracted to a temporary
    directory (removed at exit). While the modules import, its packages stand in for this
    checkout's in ``sys.modules``, so that their own imports (``ft.*``, ``bench.*``) resolve within
    `rev`; this checkout's modules are back in place when the call returns.

    Raises: subprocess.CalledProcessError when `rev` is not a revision of the repository.
    """
    tops = {"ft"} | {p.split("/")[0] for p in files.values()}
    root = Path(tempfile.mkdtemp(prefix=f"ft-{rev}-"))
    atexit.register(shutil.rmtree, root, True)
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "--", *sorted(tops)], cwd=REPO, check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    shadowed = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in tops}
    sys.path.insert(0, str(root))
    try:
        modules = {}
        for name, path in files.items():
            module_name = "_rev_" + re.sub(r"\W", "_", rev) + "_" + name
            spec = importlib.util.spec_from_file_location(module_name, root / path)
            modules[name] = sys.modules[module_name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(modules[name])
        return modules
    finally:
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k.split(".")[0] in tops]:
            del sys.modules[k]
        sys.modules.update(shadowed)
