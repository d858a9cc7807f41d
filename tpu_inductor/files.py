"""Writes no reader sees half done: the one atomic writer of the compile cache, the AOT
compiler and the dumps.

A file or directory is written under a temporary name beside its destination and renamed into
place. Temporary names are `.tmp-<tag>-<pid>-<hex8>` (`TEMP_NAME`), so a directory's owner can
tell an interrupted writer's leftovers from anything else (the `.tmp-rm-<hex12>` of earlier
versions, too).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

TEMP_PREFIX = ".tmp-"
TEMP_NAME = re.compile(r"\.tmp-(?:[0-9a-z]+-\d+-[0-9a-f]{8}|rm-[0-9a-f]{12})")


def temp_beside(path: Path, tag: str) -> Path:
    """A fresh temporary name in `path`'s directory; `tag` says what it is for."""
    return path.with_name(f"{TEMP_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(4)}")


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write `path` whole, replacing what was there: a reader sees the old file or the new."""
    temp = temp_beside(path, "w")
    try:
        if isinstance(data, str):
            temp.write_text(data)
        else:
            temp.write_bytes(data)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def publish(staging: Path, final: Path, *, replace: bool) -> bool:
    """Rename the finished directory `staging` to `final`. A `final` already there is replaced
    whole (`replace`), or kept (another writer was first): then `staging` is removed and the
    result is False."""
    if replace and final.exists():
        old = temp_beside(final, "old")
        os.rename(final, old)
        os.rename(staging, final)
        remove_tree(old)
        return True
    try:
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():
            raise
        remove_tree(staging)
        return False
    return True


@contextlib.contextmanager
def staged_directory(final: Path) -> Iterator[Path]:
    """A new directory to fill, published at `final` (replacing it) if the block succeeds; on
    a failure nothing is left and `final` is as it was."""
    final = final.absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = temp_beside(final, "stage")
    staging.mkdir()
    try:
        yield staging
        publish(staging, final, replace=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already unless the block failed


def remove_tree(path: Path) -> None:
    """Remove a directory so that no reader sees it half-deleted (renamed away first)."""
    trash = temp_beside(path, "rm")
    try:
        os.rename(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)
