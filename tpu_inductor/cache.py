"""The compile cache: a key of named entries → a compiled executable and its call description.

The key is an ordered list of (name, value) entries, each hashed on its own with sha256 and the
list hashed again, so that a miss can be explained entry by entry (`explain`). This module has
the memory level; counters say what happened (tests assert on them).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

# "hit", "miss", "bypass": lookups by outcome, for the whole process.
counters: collections.Counter = collections.Counter()


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """An ordered list of named entries and their hashes."""

    entries: tuple[tuple[str, str], ...]  # (name, sha256 of the entry's repr)

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


class MemoryCache:
    """key digest → compiled value, for the life of the process."""

    def __init__(self) -> None:
        self._entries: dict[str, Any] = {}

    def get_or_compile(self, entries: Sequence[tuple[str, Any]], compile_fn: Callable[[], Any]):
        try:
            key = CacheKey.of(entries)
        except UnhashableEntry as e:
            counters["bypass"] += 1
            log.debug("compile cache bypassed: %s", e)
            return compile_fn()
        value = self._entries.get(key.digest)
        if value is not None:
            counters["hit"] += 1
            return value
        counters["miss"] += 1
        value = compile_fn()
        self._entries[key.digest] = value
        return value

    def clear(self) -> None:
        self._entries.clear()


memory_cache = MemoryCache()
