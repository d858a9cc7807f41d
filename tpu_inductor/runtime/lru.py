"""A mapping that keeps its most recently used entries: the compile caches' bound (the
memory cache, the executables by module, the concrete-size compiles of a graph)."""

from __future__ import annotations

import collections
from typing import Any


class RecentlyUsed:
    """A mapping that keeps its `limit` most recently used entries (a `get` hit counts)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._entries: collections.OrderedDict[Any, Any] = collections.OrderedDict()

    def get(self, key) -> Any:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key, value) -> bool:
        """Keep `value`; whether the least recently used entry was dropped to make room."""
        self._entries[key] = value
        if len(self._entries) <= self.limit:
            return False
        self._entries.popitem(last=False)
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
