"""torch's AOTAutogradCache carrying our compiled graphs: a warm process skips AOTAutograd too.

With the compile cache on, the backend hands AOTAutograd its compilers as
`SerializableAOTDispatchCompiler`s, so AOTAutograd looks its own cache up before tracing. Its key
covers the Dynamo graph, input metadata, grad and autocast state, torch's version and configs,
and the graph module's `_backend_id`, which `backend_id` makes the digest of our compile cache
key's context (key.context_entries: options, the passes' identity, sources, PJRT environment).
Its entries are pickles under torch's cache directory (TORCHINDUCTOR_CACHE_DIR), bundled with
the OutputCode our compilers return: `CachedGraph`.

A CachedGraph pickles the compile-cache key of its graph and input signature, never the
executable. On a hit, `post_compile` loads the executable from our checksummed, private compile
cache, under this process's options and environment, with the loader the backend call gave
`active` (compile_fx.load_cached); when it is not there (evicted, cleared),
AOTAutograd counts a bypass and compiles as usual, which stores it again. Graphs that are split
(ops without a lowering) or have symbolic sizes are not stored: asked to serialize, their
CachedGraph bypasses AOTAutograd's cache.

The backward graph is compiled with the forward (not at the first backward call), so that a
training graph's entry is written while this module's configuration is in force.

Computing the key, torch registers Inductor's code generators for every device (to hash their
custom passes), which imports Inductor's codegen: a share of every first call, cold or warm,
for code generators we never run (docs/benchmarks.md). `active` skips that registration inside our backend call (a
switch in front of torch's function, per thread and task, installed at the first call); the key
then hashes the custom passes registered so far (none, unless Inductor ran in this process),
which can only make a key differ from another process's, never match one it should not.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._inductor.output_code import OutputCode

from tpu_inductor.config import Options

# (kind, graph key, static inputs, example inputs, options, roles) -> the compiled graph or None
Loader = Callable[..., Any]
# The backend call in progress, for `post_compile` (AOTAutograd calls it inside): its options
# and the loader of a cached graph.
_active: contextvars.ContextVar[tuple[Options, Loader]] = contextvars.ContextVar(
    "tpu_inductor_active"
)
# Whether torch's cache key skips registering Inductor's code generators (see above).
_skip_codegen_registration: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "tpu_inductor_skip_codegen_registration", default=False
)


class CachedGraph(OutputCode):
    """A compiled graph as AOTAutograd's cache sees it: an OutputCode that pickles to its key."""

    def __init__(
        self,
        compiled: Callable[[list], list],
        kind: str,
        static_inputs: Sequence[int],
        roles=None,
    ):
        self._boxed_call = True
        self.compiled: Callable[[list], list] | None = compiled
        self.kind = kind
        self.static_inputs = tuple(static_inputs)
        self.roles = roles  # compile_fx.compile_graph's
        self.graph_key = getattr(compiled, "graph_key", None)  # None: not storable

    def __call__(self, args: list) -> list:
        return self.compiled(args)

    def prepare_for_serialization(self) -> None:
        """Called on a copy about to be pickled: keep the key, drop the executable."""
        from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache

        if self.graph_key is None:
            raise BypassAOTAutogradCache(
                "tpu_inductor: a split graph or one with symbolic sizes is not stored"
            )
        self.compiled = None

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs) -> None:
        """On an AOTAutogradCache hit: load the executable from our compile cache."""
        from tpu_inductor.exc import CacheError

        active = _active.get(None)
        if active is None:
            raise CacheError(
                "tpu_inductor: an AOTAutograd cache entry was loaded outside a tpu_inductor "
                "backend call (no options to load it under); AOTAutograd compiles it instead"
            )
        options, load = active
        compiled = load(
            self.kind, self.graph_key, self.static_inputs, example_inputs, options, self.roles
        )
        if compiled is None:  # AOTAutograd then counts a bypass and compiles
            raise CacheError(
                f"tpu_inductor: compile-cache entry {self.graph_key} is gone (evicted or "
                "cleared); AOTAutograd compiles the graph again, which stores it anew"
            )
        self.compiled = compiled


def enabled(gm: torch.fx.GraphModule, options: Options) -> bool:
    """Whether to use AOTAutograd's cache for `gm`: our cache is on, and no one else (Dynamo's
    precompile) has named the graph's backend already."""
    return options.cache and getattr(gm, "_backend_id", None) is None


def backend_id(options: Options) -> str:
    """What AOTAutograd's key knows of us: the context of our compile cache's key (options,
    the passes that will run on the graph it caches, sources and environment)."""
    from tpu_inductor.cache import key
    from tpu_inductor.runtime import devices

    device = devices.select_device(options.device)
    return "tpu_inductor-" + key.CacheKey.of(key.context_entries(options, device)).digest


@contextlib.contextmanager
def active(options: Options, load: Loader) -> Iterator[None]:
    """The scope of one backend call: AOTAutograd configured to bundle our graphs, which a
    cache hit loads with `load` under `options`."""
    token = _active.set((options, load))
    try:
        with (
            torch._functorch.config.patch(
                bundled_autograd_cache=True, force_non_lazy_backward_lowering=True
            ),
            _without_codegen_registration(),
        ):
            yield
    finally:
        _active.reset(token)


@contextlib.contextmanager
def _without_codegen_registration() -> Iterator[None]:
    """torch's cache key computed without importing Inductor's code generators (see above)."""
    _install_registration_switch()
    token = _skip_codegen_registration.set(True)
    try:
        yield
    finally:
        _skip_codegen_registration.reset(token)


@functools.cache
def _install_registration_switch() -> None:
    from torch._inductor import codecache

    register = codecache.init_backend_registration

    def init_backend_registration() -> None:
        if not _skip_codegen_registration.get():
            register()

    codecache.init_backend_registration = init_backend_registration
