"""The compile cache's half of compile_fx's compile stage: `find` a compiled value by its key
(memory, then disk) and `store` one compiled on a miss (memory and disk). A value is
(executable, LoweredModule); the disk level holds it through `serialize.disk_codec`.

Each compile's CompileRecord gets the decision ("memory_hit", "disk_hit", "miss", or "bypass"
for a key that could not be hashed: None), the key digest and the disk directory, and the
"cache_load" and "cache_store" stage times.
"""

from __future__ import annotations

from typing import Any

from tpu_inductor.cache import serialize, stores
from tpu_inductor.cache.key import CacheKey
from tpu_inductor.config import Options
from tpu_inductor.debug import records
from tpu_inductor.runtime import devices


def find(
    key: CacheKey | None, options: Options, device: devices.Device, record: records.CompileRecord
) -> tuple[Any, Any] | None:
    """The (executable, lowered module) stored for `key`, from memory, then disk; None on a
    miss (or a bypass: no key). A hit shows what it found to the record (dumps); a value in
    memory but not on disk (compiled while the disk cache was off) is stored there too."""
    info = record.cache
    if key is None:
        stores.counters["bypass"] += 1
        info["decision"] = "bypass"
        return None
    info["key"] = key.digest
    disk = _disk(options)
    value = stores.memory_cache.get(key)
    if value is not None:
        stores.counters["hit"] += 1
        info["decision"] = "memory_hit"
        if disk is not None and not disk.holds(key):
            _store_on_disk(disk, key, value, device, record)
    elif disk is not None:
        info["dir"] = str(disk.directory)
        with record.stage("cache_load"):
            value = disk.load(key, serialize.disk_codec(device).decode)
        if value is not None:
            stores.counters["disk_hit"] += 1
            info["decision"] = "disk_hit"
            stores.memory_cache.put(key, value)
    if value is None:
        stores.counters["miss"] += 1
        info["decision"] = "miss"
        return None
    executable, lowered = value
    record.show(lowered)
    record.show(executable)
    return value


def store(
    key: CacheKey | None,
    value: tuple[Any, Any],
    options: Options,
    device: devices.Device,
    record: records.CompileRecord,
) -> None:
    """Keep a value compiled on a miss, in memory and (cache on) on disk; nothing on a bypass."""
    if key is None:
        return
    stores.memory_cache.put(key, value)
    disk = _disk(options)
    if disk is not None:
        _store_on_disk(disk, key, value, device, record)


def _disk(options: Options) -> stores.DiskCache | None:
    return (
        stores.open_disk_cache(options.cache_dir, options.cache_max_mb) if options.cache else None
    )


def _store_on_disk(disk: stores.DiskCache, key: CacheKey, value, device, record) -> None:
    codec = serialize.disk_codec(device)
    with record.stage("cache_store"):
        disk.store(key, lambda: codec.encode(value), f"{record.graph} {record.inputs}")
