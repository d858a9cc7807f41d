"""The compile cache: a key of named entries → a compiled executable and its call description.

The key is an ordered list of (name, value) entries, each hashed on its own with sha256 and the
list hashed again, so that a miss can be explained entry by entry (`explain`).

Two levels. Memory: key digest → value, for the life of the process. Disk (`DiskCache`): one
directory per key digest holding the value's files (serialized executable, StableHLO) and a
`manifest.json` with the key, a checksum of every file and of the manifest itself. Writes go to
a temporary directory renamed into place (atomic; of two processes storing one key, one wins).
Any read fault (truncated, corrupted, foreign, unreadable) is a warning, the entry is removed
and the value recompiled; a directory that cannot be searched, listed or written is a warning
and a compile without it. The directory must be private to its owner: a deserialized
executable is code that runs in this process. Size-capped, least recently used evicted first;
temporary directories left by interrupted processes are removed once stale.

`counters` say what happened, for the whole process (tests assert on them): "hit" (memory),
"disk_hit", "miss" (compiled), "bypass" (unhashable key), "disk_fault", "disk_store",
"disk_skip" (a value with no disk form), "disk_evict".
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tpu_inductor import files
from tpu_inductor.exc import CacheError
from tpu_inductor.runtime.lru import RecentlyUsed

log = logging.getLogger(__name__)

counters: collections.Counter = collections.Counter()

FORMAT = 2  # layout version of a disk entry; entries of another format are ignored
MANIFEST = "manifest.json"
# `store` and `files.remove_tree` name their temporary directories as `files.TEMP_NAME` says
# (".tmp-<digest16>-<pid>-<hex8>", ".tmp-rm-<pid>-<hex8>"). Older than `_STALE_SECONDS`, one is
# a leftover of an interrupted process (a live writer finishes in far less) and `evict`/`clear` remove it.
_STALE_SECONDS = 15 * 60
_DIGEST = re.compile(r"[0-9a-f]{64}")  # the name of an entry's directory


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """An ordered list of named entries and their hashes."""

    entries: tuple[tuple[str, str], ...]  # (name, sha256 of the entry's canonical text)

    @classmethod
    def of(cls, entries: Sequence[tuple[str, Any]]) -> CacheKey:
        return cls(tuple((name, _sha256(_canonical(value))) for name, value in entries))

    @property
    def digest(self) -> str:
        return _sha256("\n".join(f"{n}={h}" for n, h in self.entries))

    def explain(self, other: CacheKey) -> list[str]:
        """The names of the entries whose values differ between two keys."""
        mine, theirs = dict(self.entries), dict(other.entries)
        return [n for n in dict.fromkeys([*mine, *theirs]) if mine.get(n) != theirs.get(n)]


class UnhashableEntry(TypeError):
    """A key entry whose value has no stable text form: the cache is bypassed."""


def _canonical(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_canonical(k)}:{_canonical(v)}" for k, v in value.items()) + "}"
    text = repr(value)
    if " at 0x" in text:  # an object identity, not a value
        raise UnhashableEntry(f"cannot hash {type(value).__name__} for the cache key: {text}")
    return text


def _sha256(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------
# Key entries that describe the environment (the graph-specific ones come from compile_fx).


def environment_entries(device) -> list[tuple[str, Any]]:
    """Versions, source (ours and the rules users registered), PJRT platform and devices, XLA
    flags: what else changes the binary."""
    from tpu_inductor import lowering

    client = device.client
    return [
        ("versions", _versions()),
        ("source", _source_digest()),
        ("user_rules", lowering.user_rules_fingerprint()),
        ("pjrt", (client.platform, client.platform_version)),
        ("devices", (device.kind, len(client.devices()))),
        ("xla_flags", xla_flags()),
    ]


def _versions() -> tuple[str, ...]:
    import jax
    import jaxlib
    import torch

    from tpu_inductor.version import __version__

    return (torch.__version__, jax.__version__, jaxlib.__version__, __version__)


@functools.cache
def _source_digest() -> str:
    """sha256 of this package's Python sources: an edited lowering rule is a different key."""
    from tpu_inductor import lowering, passes

    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]  # tpu_inductor/, every room of it
    for root in sorted({package, *map(Path, lowering.__path__), *map(Path, passes.__path__)}):
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def graph_fingerprint(gm, salt: Callable[[Any], Any] = lambda _node: None) -> str:
    """A graph's computation, whatever its nodes are named: each node by its position, op,
    target and arguments (other nodes by position) and `salt(node)` (what else its lowering
    reads, e.g. a random op's stream), and its tensor constants' data. Dynamo's and
    torch.export's traces of one program name their inputs differently; they key alike."""
    import torch

    position: dict = {}
    digest = hashlib.sha256()
    for node in gm.graph.nodes:
        position[node] = len(position)
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{position[n]}")
        target = "" if node.op in ("placeholder", "get_attr") else _target_name(node.target)
        digest.update(f"{node.op} {target} {args!r} {salt(node)!r}\n".encode())
        if node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            if isinstance(value, torch.Tensor):
                data = value.detach().cpu().contiguous()
                digest.update(f"{data.dtype}:{tuple(data.shape)}".encode())
                raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
                digest.update(raw)
    return digest.hexdigest()


def _target_name(target) -> str:
    from torch._ops import OpOverload

    if isinstance(target, OpOverload):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', target)!s}"


def xla_flags() -> tuple[str, ...]:
    """XLA_FLAGS less the dump flags, which do not change the compiled program."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return tuple(f for f in flags if not f.startswith("--xla_dump"))


# ---------------------------------------------------------------------------------------------
# The memory level and the lookup through both levels.


@dataclasses.dataclass(frozen=True)
class Codec:
    """How a compiled value crosses to disk: value → (files, JSON meta) and back."""

    encode: Callable[[Any], tuple[dict[str, bytes], dict[str, Any]]]
    decode: Callable[[dict[str, bytes], dict[str, Any]], Any]


class MemoryCache:
    """key digest → compiled value, the `max_entries` most recently used; optionally backed by
    disk. (A value also lives as long as a compiled graph uses it.)"""

    def __init__(self, max_entries: int = 128) -> None:
        self._entries = RecentlyUsed(max_entries)

    def get_or_compile(
        self,
        entries: Sequence[tuple[str, Any]] | CacheKey,
        compile_fn: Callable[[], Any] | None,
        *,
        disk: DiskCache | None = None,
        codec: Codec | None = None,
        info: dict[str, Any] | None = None,
        stage: Callable[[str], Any] = lambda _name: contextlib.nullcontext(),
        label: str = "",
    ):
        """The cached value for `entries` (or a key), from memory, then disk, else `compile_fn()`.

        `info` receives the decision ("memory_hit", "disk_hit", "miss", "bypass") and the key
        digest; `stage(name)` times the "cache_load" and "cache_store" stages. Without a
        `compile_fn` a miss returns None.
        """
        info = {} if info is None else info
        try:
            key = entries if isinstance(entries, CacheKey) else CacheKey.of(entries)
        except UnhashableEntry as e:
            counters["bypass"] += 1
            info["decision"] = "bypass"
            log.debug("compile cache bypassed: %s", e)
            return compile_fn()
        info["key"] = key.digest
        value = self._entries.get(key.digest)
        if value is not None:
            counters["hit"] += 1
            info["decision"] = "memory_hit"
            if disk is not None and codec is not None and not disk.holds(key):
                with stage("cache_store"):  # compiled while the disk cache was off
                    disk.store(key, lambda: codec.encode(value), label)
            return value
        if disk is not None and codec is not None:
            info["dir"] = str(disk.directory)
            with stage("cache_load"):
                value = disk.load(key, codec.decode)
            if value is not None:
                counters["disk_hit"] += 1
                info["decision"] = "disk_hit"
                self._entries.put(key.digest, value)
                return value
        counters["miss"] += 1
        info["decision"] = "miss"
        if compile_fn is None:
            return None
        value = compile_fn()
        self._entries.put(key.digest, value)
        if disk is not None and codec is not None:
            with stage("cache_store"):
                disk.store(key, lambda: codec.encode(value), label)
        return value

    def clear(self) -> None:
        self._entries.clear()


memory_cache = MemoryCache()


# ---------------------------------------------------------------------------------------------
# The disk level.


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
                "files": {n: {"sha256": _sha256(d), "size": len(d)} for n, d in contents.items()},
                "meta": meta,
            }
            manifest = {"checksum": _sha256(_dump(body)), "body": body}
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
    if not isinstance(body, dict) or _sha256(_dump(body)) != checksum:
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
    if _sha256(data) != meta.get("sha256"):
        raise _Fault(f"{path.name} checksum mismatch")
    return data


# ---------------------------------------------------------------------------------------------
# `tpu-inductor cache stats | ls | clear | explain A B`


def add_subcommands(commands) -> None:
    """Add the `cache` command group to the `tpu-inductor` parser."""
    parser = commands.add_parser("cache", help="inspect or clear the persistent compile cache")
    parser.add_argument(
        "--dir", help="cache directory (default: TPU_INDUCTOR_CACHE_DIR or the user cache)"
    )
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("stats", help="entries, total size and the size cap").set_defaults(
        run=_cli_stats
    )
    actions.add_parser("ls", help="list entries, least recently used first").set_defaults(
        run=_cli_ls
    )
    actions.add_parser("clear", help="remove every entry").set_defaults(run=_cli_clear)
    explain = actions.add_parser("explain", help="which key entries differ between two entries")
    explain.add_argument("key_a")
    explain.add_argument("key_b")
    explain.set_defaults(run=_cli_explain)


def _cli_cache(args) -> DiskCache:
    """The cache the command names; never created (these commands only read or remove)."""
    from tpu_inductor.config import Options

    options = Options.from_user()
    directory = args.dir if args.dir is not None else options.cache_dir
    return open_disk_cache(directory, options.cache_max_mb, create=False)


def _cli_stats(args) -> int:
    disk = _cli_cache(args)
    entries = disk.entries()
    total = sum(e.size for e in entries)
    print(f"directory: {disk.directory}")
    print(f"entries:   {len(entries)}")
    print(f"size:      {total / 2**20:.1f} MiB of {disk.max_bytes / 2**20:.0f} MiB")
    leftovers = disk.leftovers()
    if leftovers:
        size = sum(f.stat().st_size for p in leftovers for f in p.rglob("*") if f.is_file())
        print(
            f"leftovers: {len(leftovers)} temporary directories of interrupted writes, "
            f"{size / 2**20:.1f} MiB (removed by the next store or `cache clear`)"
        )
    return 0


def _cli_ls(args) -> int:
    for entry in _cli_cache(args).entries():
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.last_used))
        print(f"{entry.digest[:16]}  {entry.size / 1024:9.1f} KiB  {used}  {entry.label}")
    return 0


def _cli_clear(args) -> int:
    disk = _cli_cache(args)
    print(f"removed {disk.clear()} entries from {disk.directory}")
    return 0


def _cli_explain(args) -> int:
    disk = _cli_cache(args)
    key_a, key_b = disk.key_of(args.key_a), disk.key_of(args.key_b)
    differ = key_a.explain(key_b)
    if not differ:
        print("the keys are equal")
    for name in differ:
        a, b = dict(key_a.entries).get(name, "-"), dict(key_b.entries).get(name, "-")
        print(f"{name}: {a[:16]} != {b[:16]}")
    return 0
