"""A private copy of the package at a commit, where mutants are written: the working tree is
never touched (nor read: others may be mid-edit there).

The copy is laid out as the package is installed (lowering/ and passes/ inside tpu_inductor/),
so with its root first on the path, and as the current directory, `import tpu_inductor` in a
test run finds the copy, never the editable install. Bytecode is not written: two mutants of
one file can share a size and a modification second.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Source folder in the repository → where it lies in the installed package.
_LAYOUT = {
    "tpu_inductor": "tpu_inductor",
    "lowering": "tpu_inductor/lowering",
    "passes": "tpu_inductor/passes",
    "tests": "tests",
}


class Workspace:
    """The copy's root and the paths and commands of test runs inside it."""

    def __init__(self, root: Path):
        self.root = root

    def path_of(self, repo_path: str) -> Path:
        """Where a repository file (lowering/ops/losses.py) lies in the copy."""
        top, _, rest = repo_path.partition("/")
        return self.root / _LAYOUT.get(top, top) / rest

    def pytest_command(self, selectors, *, first_failure: bool = True) -> str:
        """The command line that runs `selectors` (paths or node ids) in a fixed order."""
        flags = ["-q", "-rf", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:xdist"]
        flags += ["-x"] if first_failure else []
        return shlex.join([sys.executable, "-m", "pytest", *flags, *selectors])


@contextlib.contextmanager
def workspace(repo: Path, rev: str = "HEAD") -> Iterator[Workspace]:
    """A fresh copy of `repo`'s package and tests at commit `rev` (a consistent state, whatever
    is being edited in the working tree), entered (cwd, PYTHONPATH) for the block."""
    root = Path(tempfile.mkdtemp(prefix="tpu-inductor-mutation-"))
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", rev, *_LAYOUT, "pyproject.toml"],
        capture_output=True,
        check=True,
    ).stdout
    staging = root / "staging"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(staging, filter="data")
    for source, target in _LAYOUT.items():
        shutil.move(staging / source, root / target)
    shutil.move(staging / "pyproject.toml", root / "pyproject.toml")  # pytest's settings
    settings = {
        "PYTHONPATH": str(root),
        "PYTHONDONTWRITEBYTECODE": "1",
        "TPU_INDUCTOR_HYPOTHESIS_PROFILE": "mutation",  # tests/conftest.py: fewer drawn cases
    }
    saved = {name: os.environ.get(name) for name in settings}
    cwd = os.getcwd()
    os.environ.update(settings)
    os.chdir(root)
    try:
        yield Workspace(root)
    finally:
        os.chdir(cwd)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(root, ignore_errors=True)
