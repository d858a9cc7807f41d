"""Stages 5-6 of compile_fx's order: the compile cache (memory, then disk) or a PJRT compile on
a miss, stored; and the compiled_graph.CompiledGraph that wraps the executable. `load_cached` is the
lookup alone, for torch's AOTAutogradCache (nothing was traced in the process that asks).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from tpu_inductor.cache import serialize
from tpu_inductor.cache import stores as cache
from tpu_inductor.config import Options
from tpu_inductor.debug import records as debug
from tpu_inductor.runtime import compiled_graph, devices
from tpu_inductor.runtime import size_dispatch as dispatch
from tpu_inductor.sharding import collectives

log = logging.getLogger(__name__)


def context_entries(options: Options, device: devices.Device) -> list[tuple[str, Any]]:
    """The compile-cache key entries besides the graph's: options and environment. The graph
    entry is the graph after the passes, with what its lowering reads besides (random streams):
    a pass that leaves a graph as it was leaves its key alone; the passes' sources are in the
    environment's source digest, the options they read in the options entry."""
    return [("options", options.cache_key_entries()), *cache.environment_entries(device)]


def cached_compile(
    graph_key: cache.CacheKey,
    options: Options,
    device: devices.Device,
    static_inputs: Sequence[int],
    record: debug.CompileRecord,
    compile_fn: Callable[[], Any] | None,
    roles: compiled_graph.GraphRoles | None = None,
) -> compiled_graph.CompiledGraph | None:
    """The graph of `graph_key` (graph and inputs entries) from the compile cache, or compiled
    by `compile_fn` and stored; None when it is not cached and there is no `compile_fn`.
    `roles`: as `compile_graph`'s."""
    key = cache.CacheKey(
        graph_key.entries + cache.CacheKey.of(context_entries(options, device)).entries
    )
    disk = None
    if options.cache:
        disk = cache.open_disk_cache(options.cache_dir, options.cache_max_mb)
    value = cache.memory_cache.get_or_compile(
        key,
        compile_fn,
        disk=disk,
        codec=serialize.disk_codec(device),
        info=record.cache,
        stage=record.stage,
        label=f"{record.graph} {record.inputs}",
    )
    if value is None:
        return None
    executable, lowered = value
    if lowered.shardings is not None:  # split over a mesh: what it communicates
        record.communication = collectives.report(executable, device, key.digest)
    if record.cache["decision"] in ("memory_hit", "disk_hit"):  # `compile_fn` showed the others
        record.show(lowered)
        record.show(executable)
    # Inputs the graph writes (a buffer, a cache passed in) are state too: their device copy,
    # written by this call, serves the next one (residency.mirrors).
    mutated = tuple(position for position, _ in lowered.mutations)
    static = tuple(dict.fromkeys((*static_inputs, *mutated))) if options.resident_params else ()
    return compiled_graph.CompiledGraph(executable, lowered, device, static, graph_key, roles)


def load_cached(
    kind: str,
    graph_key: cache.CacheKey,
    static_inputs: Sequence[int],
    example_inputs: Sequence[Any],
    options: Options,
    roles: compiled_graph.GraphRoles | None = None,
) -> compiled_graph.CompiledGraph | None:
    """A graph compiled by an earlier process, from the compile cache only (None if absent).

    For torch's AOTAutogradCache, which keeps `graph_key` and not the graph: the rest of the
    key comes from this process's options and environment.
    """
    device = devices.select_device(options.device)
    observer = debug.GraphObserver(debug.graph_name(kind), options)
    record = observer.record(dispatch.input_signature(example_inputs))
    record.cache["aot_autograd"] = "hit"
    record.cache["stages_skipped"] = "ATen graph and passes: nothing was traced in this process"
    roles = kept_roles(roles, options)
    compiled = cached_compile(graph_key, options, device, static_inputs, record, None, roles)
    if compiled is None:
        record.status, record.error = "failed", "not in the compile cache: compiled again"
        return None
    record.transfers = compiled.transfer_summary()
    debug.finish(record)
    return compiled


def kept_roles(
    roles: compiled_graph.GraphRoles | None, options: Options
) -> compiled_graph.GraphRoles:
    """`roles`, with no saved output kept on the device under `saved_on_device=False`, and
    written state and gradients left on the device under `host_sync="explicit"` (where host
    storages can be marked stale here: else with a warning, brought up to date each call)."""
    roles = roles or compiled_graph.GraphRoles()
    defer = options.host_sync == "explicit" and _can_defer()
    return dataclasses.replace(roles, keep_saved=options.saved_on_device, defer_host=defer)


@functools.cache
def _can_defer() -> bool:
    from tpu_inductor.runtime.host_sync import host_sync

    why = host_sync.available()
    if why is not None:
        log.warning("%s Host copies are brought up to date after each call instead.", why)
    return why is None
