"""The compile cache's two stores: a key (key.py) → a compiled executable and what calls it.

Memory: key digest → value, for the life of the process. Disk (`DiskCache`): one
directory per key digest holding the value's files (serialized executable, StableHLO) and a
`manifest.json` with the key, a checksum of every file and of the manifest itself. Writes go to
a temporary directory renamed into place (atomic; of two processes storing one key, one wins).
Any read fault (truncated, corrupted, foreign, unreadable) is a warning, the entry is removed
and the value recompiled; a directory that cannot be searched, listed or written is a warning
and a compile without it. The directory must be private to its owner: a deserialized
executable is code that runs in this process. Size-capped, least recently used evicted first;
temporary directories left by interrupted processes are removed once stale.

`counters` say what happened, for the whole process (tests assert on them): "hit" (memory),
"disk_hit", "miss" (compiled), "bypass" (unhashable key) counted by the lookup (lookup.py), and
"disk_fault", "disk_store", "disk_skip" (a value with no disk form), "disk_evict" here.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tpu_inductor import files
from tpu_inductor.cache.key import CacheKey, sha256
from tpu_inductor.exc import CacheError
from tpu_inductor.runtime.lru import RecentlyUsed

log = logging.getLogger(__name__)

counters: collections.Counter = collections.Counter()

FORMAT = 2  # layout version of a disk entry; entries of another format are ignored
MANIFEST = "manifest.json"
# `store` and `files.remove_tree` name their temporary directories as `files.TEMP_NAME` says
# (".tmp-<digest16>-<pid>-<hex8>", ".tmp-rm-<pid>-<hex8>"). Older than `_STALE_SECONDS`, one is
# a leftover of an interrupted process (a live writer finishes in far less) and `evict`/`clear`
# remove it.
_STALE_SECONDS = 15 * 60
_DIGEST = re.compile(r"[0-9a-f]{64}")  # the name of an entry's directory


# ---------------------------------------------------------------------------------------------
# The memory level.


class MemoryCache:
    """key digest → compiled value, the `max_entries` most recently used. (A value also lives
    as long as a compiled graph uses it.)"""

    def __init__(self, max_entries: int = 128) -> None:
        self._entries = RecentlyUsed(max_entries)

    def get(self, key: CacheKey) -> Any:
        """The value stored for `key`, or None."""
        return self._entries.get(key.digest)

    def put(self, key: CacheKey, value: Any) -> None:
        self._entries.put(key.digest, value)

    def clear(self) -> None:
        self._entries.clear()


memory_cache = MemoryCache()


# ---------------------------------------------------------------------------------------------
# The disk level.


@dataclasses.dataclass(frozen=True)
class Codec:
    """How a compiled value crosses to disk: value → (files, JSON meta) and back."""

    encode: Callable[[Any], tuple[dict[str, bytes], dict[str, Any]]]
    decode: Callable[[dict[str, bytes], dict[str, Any]], Any]


class _Fault(Exception):
    """Why a disk entry cannot be used (internal: becomes a warning and a recompile)."""


@dataclasses.dataclass(frozen=True)
class EntryInfo:
    """One disk entry as `ls` shows it."""

    digest: str
    size: int  # bytes
    last_used: float  # seconds since the epoch (the manifest's mtime)
    label: str


def default_directory() -> Path:
    """The user's cache directory for tpu_inductor (platformdirs)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("tpu_inductor")) / "compile"


def open_disk_cache(
    directory: str | os.PathLike | None, max_mb: int, *, create: bool = True
) -> DiskCache:
    """The disk cache at `directory` (None: `default_directory()`), created private if absent.

    With `create=False` (commands that only read or clear it) an absent directory is a
    CacheError rather than created.
    """
    if directory is not None and not os.fspath(directory):
        raise CacheError(
            "tpu_inductor: the compile cache directory is an empty path; give a directory (--dir, "
            "TPU_INDUCTOR_CACHE_DIR or options={'cache_dir': ...}) or leave it unset for the "
            "default."
        )
    path = Path(directory) if directory is not None else default_directory()
    if not create and not path.expanduser().is_dir():
        raise CacheError(
            f"tpu_inductor: there is no compile cache at {path}: the directory does not exist. "
            "Check the path given with --dir or TPU_INDUCTOR_CACHE_DIR (nothing was cached there)."
        )
    return DiskCache(path, max_mb * 2**20)


class DiskCache:
    """Key digest → a directory of files and a checksummed manifest, under one private root."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory = directory.expanduser().absolute()
        self.max_bytes = max_bytes
        _make_private(self.directory)

    def holds(self, key: CacheKey) -> bool:
        """Whether an entry for `key` is stored (not checked: `load` does that)."""
        return (self.directory / key.digest).is_dir()

    def load(self, key: CacheKey, decode: Callable[[dict[str, bytes], dict], Any]):
        """The decoded value stored for `key`, or None (absent, or a fault: warned, removed)."""
        path = self.directory / key.digest
        try:
            if not path.exists():
                return None
        except OSError as e:  # the directory cannot be searched: compile without it
            self._warn_unusable("cannot search it; compiling without it", e)
            return None
        try:
            manifest = _read_manifest(path / MANIFEST)
            _check_owner_entry(manifest, key)
            contents = {
                name: _read_checked(path / name, meta) for name, meta in manifest["files"].items()
            }
            try:
                value = decode(contents, manifest["meta"])
            except Exception as e:  # a decoder error of any kind means: recompile
                raise _Fault(f"cannot decode it: {type(e).__name__}: {e}") from e
        except (_Fault, OSError) as e:
            counters["disk_fault"] += 1
            log.warning(
                "tpu_inductor: compile cache entry %s is unusable (%s); it is removed and the "
                "graph recompiled.",
                path,
                e,
            )
            files.remove_tree(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path / MANIFEST)  # last use, for LRU eviction
        return value

    def store(self, key: CacheKey, encode: Callable[[], tuple[dict[str, bytes], dict]], label: str):
        """Write the entry for `key` atomically; failures are warnings, never errors."""
        try:
            contents, meta = encode()
        except ValueError as e:  # the value has no disk form (e.g. a non-JSON output value)
            counters["disk_skip"] += 1
            log.debug("compile cache: not stored on disk: %s", e)
            return
        except Exception as e:  # e.g. PJRT cannot serialize an executable (XLA:CPU's sort of
            counters["disk_skip"] += 1  # complex numbers: "`LessThan` is not serializable")
            log.warning(
                "tpu_inductor: compile cache: %s is not stored on disk (compiled again in a new "
                "process): %s: %s",
                label,
                type(e).__name__,
                e,
            )
            return
        temp = files.temp_beside(self.directory / key.digest, key.digest[:16])
        try:
            temp.mkdir(mode=0o700)
            for name, data in contents.items():
                (temp / name).write_bytes(data)
            body = {
                "format": FORMAT,
                "digest": key.digest,
                "key": [list(entry) for entry in key.entries],
                "label": label,
                "files": {n: {"sha256": sha256(d), "size": len(d)} for n, d in contents.items()},
                "meta": meta,
            }
            manifest = {"checksum": sha256(_dump(body)), "body": body}
            (temp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            if not files.publish(temp, self.directory / key.digest, replace=False):
                return  # another process stored this key first: theirs is kept
            counters["disk_store"] += 1
        except OSError as e:
            self._warn_unusable("cannot write an entry in it; compiling without it", e)
            files.remove_tree(temp)
            return
        try:
            self.evict()
        except OSError as e:  # the directory cannot be listed
            self._warn_unusable("cannot list it to keep it under its size cap", e)

    def _warn_unusable(self, problem: str, error: OSError) -> None:
        log.warning(
            "tpu_inductor: compile cache directory %s: %s (%s). Make it readable and writable "
            "by you (`chmod 700 %s`), or choose another with TPU_INDUCTOR_CACHE_DIR or "
            "options={'cache_dir': ...}.",
            self.directory,
            problem,
            error.strerror or error,
            self.directory,
        )

    def entries(self) -> list[EntryInfo]:
        """Every entry in the directory, least recently used first (unreadable ones skipped)."""
        found = []
        for path in self.directory.iterdir():
            if len(path.name) != 64 or not path.is_dir():
                continue
            try:
                body = _read_manifest(path / MANIFEST)
                size = sum(f.stat().st_size for f in path.iterdir())
                found.append(
                    EntryInfo(path.name, size, (path / MANIFEST).stat().st_mtime, body["label"])
                )
            except (_Fault, OSError, KeyError):
                continue
        return sorted(found, key=lambda e: e.last_used)

    def key_of(self, digest_prefix: str) -> CacheKey:
        """The key of the entry whose digest starts with `digest_prefix` (CacheError if none)."""
        matches = [p for p in self.directory.iterdir() if p.name.startswith(digest_prefix)]
        matches = [p for p in matches if not p.name.startswith(files.TEMP_PREFIX)]
        if len(matches) != 1:
            raise CacheError(
                f"tpu_inductor: {len(matches)} cache entries in {self.directory} start with "
                f"{digest_prefix!r}; give a longer, unique prefix (see `tpu-inductor cache ls`)."
            )
        try:
            return _stored_key(_read_manifest(matches[0] / MANIFEST))
        except (_Fault, OSError) as e:
            raise CacheError(
                f"tpu_inductor: cache entry {matches[0]} is unreadable: {e}. It is replaced when "
                "its graph is compiled again; `tpu-inductor cache clear` removes it."
            ) from e

    def leftovers(self) -> list[Path]:
        """Temporary directories of interrupted stores and removals (older than a few minutes)."""
        now = time.time()
        found = []
        for path in self.directory.iterdir():
            if not files.TEMP_NAME.fullmatch(path.name):
                continue
            with contextlib.suppress(OSError):
                if path.is_dir() and now - path.stat().st_mtime > _STALE_SECONDS:
                    found.append(path)
        return found

    def evict(self) -> None:
        """Remove stale temporary directories, then least recently used entries until the total
        size fits `max_bytes`."""
        for path in self.leftovers():
            files.remove_tree(path)
        entries = self.entries()
        total = sum(e.size for e in entries)
        for entry in entries:
            if total <= self.max_bytes:
                break
            files.remove_tree(self.directory / entry.digest)
            total -= entry.size
            counters["disk_evict"] += 1
            log.info("tpu_inductor: compile cache evicted %s (%d bytes)", entry.digest, entry.size)

    def clear(self) -> int:
        """Remove every entry (and stale temporary directories); returns how many entries.

        Only what this module wrote goes: a directory named by a digest that holds a manifest
        (readable or not), and temporary directories named as `store` names them."""
        removed = 0
        for path in self.leftovers():
            files.remove_tree(path)
        for path in self.directory.iterdir():
            if _DIGEST.fullmatch(path.name) and (path / MANIFEST).is_file():
                files.remove_tree(path)
                removed += 1
        return removed


def _make_private(directory: Path) -> None:
    """Create `directory` (mode 700) or check that it is ours and writable by no one else."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        stat = directory.stat()
    except OSError as e:
        raise CacheError(
            f"tpu_inductor: cannot create the compile cache directory {directory}: {e}. Choose "
            "another with TPU_INDUCTOR_CACHE_DIR or options={'cache_dir': ...}, or disable the "
            "cache with TPU_INDUCTOR_CACHE=0."
        ) from e
    if not hasattr(os, "getuid"):
        return
    problem = None
    if stat.st_uid != os.getuid():
        problem = f"it is owned by user id {stat.st_uid}, not by you ({os.getuid()})"
    elif stat.st_mode & 0o022:
        problem = f"it is writable by group or others (mode {stat.st_mode & 0o777:o})"
    if problem:
        raise CacheError(
            f"tpu_inductor: refusing the compile cache directory {directory}: {problem}. "
            "Executables loaded from it run in this process, so whoever can write there could "
            f"run code as you. Fix it with `chmod 700 {directory}` (if it is yours), or choose "
            "another with TPU_INDUCTOR_CACHE_DIR or options={'cache_dir': ...}."
        )


def _dump(body: dict) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _read_manifest(path: Path) -> dict[str, Any]:
    """The verified body of a manifest (format and checksum checked)."""
    try:
        manifest = json.loads(path.read_text())
        body, checksum = manifest["body"], manifest["checksum"]
    except (ValueError, KeyError, TypeError) as e:
        raise _Fault(f"malformed manifest: {type(e).__name__}: {e}") from e
    if not isinstance(body, dict) or sha256(_dump(body)) != checksum:
        raise _Fault("manifest checksum mismatch")
    if body.get("format") != FORMAT:
        raise _Fault(f"entry format {body.get('format')!r}, this version reads {FORMAT}")
    return body


def _stored_key(body: dict) -> CacheKey:
    """The key a manifest body records (a _Fault if it is not a list of [name, hash] pairs)."""
    stored = body.get("key")
    if not isinstance(stored, list) or not all(
        isinstance(e, list) and len(e) == 2 and all(isinstance(v, str) for v in e) for e in stored
    ):
        raise _Fault(f"manifest key is {stored!r:.60}, not a list of [name, hash] pairs")
    return CacheKey(tuple((name, digest) for name, digest in stored))


def _check_owner_entry(body: dict, key: CacheKey) -> None:
    if body.get("digest") != key.digest or _stored_key(body) != key:
        raise _Fault("the entry belongs to another key")
    if not isinstance(body.get("files"), dict) or not isinstance(body.get("meta"), dict):
        raise _Fault("manifest without files or meta")


def _read_checked(path: Path, meta: Any) -> bytes:
    data = path.read_bytes()
    if not isinstance(meta, dict) or len(data) != meta.get("size"):
        raise _Fault(f"{path.name} has {len(data)} bytes, the manifest says {meta!r}")
    if sha256(data) != meta.get("sha256"):
        raise _Fault(f"{path.name} checksum mismatch")
    return data
