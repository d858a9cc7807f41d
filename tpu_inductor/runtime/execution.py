"""Running a loaded executable: jax's C++ fast path (the one jit calls through) on one device,
Python's execute over a mesh.

`Runner(executable, device, lowered)(arrays)` gives one jax array per module result. On one
device it calls through jax's C++ fast path, the C++ object (jaxlib's `pjit`) a `jax.jit`
function is called through: it checks the arguments' signature, puts host (numpy) arguments
on the device, runs the executable and builds the result arrays without entering Python;
Python runs only on a cache miss. Our executables are compiled by our own PJRT client, not by
jit, so we build that object ourselves: its cache miss runs the executable from Python once
(`LoadedExecutable.execute_sharded`) and hands the C++ side what jit's own miss hands it (the
executable, the argument and result shardings, the result avals): faster per call than
Python's execute and result arrays (docs/benchmarks.md, "Per call").

The object is jax-internal (jaxlib 0.10's signature): where this jax builds it differently,
`executable_call` returns None and the runtime keeps the Python path (logged once).
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable

from tpu_inductor.sharding import placement as mesh_placement

log = logging.getLogger(__name__)
# Calls the C++ fast path handed back to Python ("misses"): one per executable where its fast
# path holds, every call where this jax's fields did not fit (process-wide; tests, the bench).
stats: collections.Counter = collections.Counter()


class Runner:
    """Runs `executable` (compiled for `device`, from module `lowered`): `runner(arrays)`,
    arrays one per module argument (on one device, numpy arrays jax sends may stand for
    some), gives one jax array per module result. Over a mesh: the result assembled from its
    shards (a replicated one too: a value left on the mesh is every device's copy)."""

    def __init__(self, executable, device, lowered):
        self._executable = executable
        self._output_specs = lowered.output_specs
        self.result_shardings = mesh_placement.result_shardings(device, lowered, executable)
        self.fast_path = None
        if not device.mesh:
            arguments = len(lowered.tensor_inputs) + lowered.uses_rng
            self.fast_path = executable_call(executable, device.device, arguments)

    def __call__(self, arrays: list) -> list:
        if self.fast_path is not None:
            return self.fast_path(*arrays)
        shards = self._executable.execute_sharded(arrays).disassemble_into_single_device_arrays()
        if self.result_shardings is None:
            return [x[0] for x in shards]
        import jax

        return [
            jax.make_array_from_single_device_arrays(spec.shape, sharding, x)
            for x, sharding, spec in zip(shards, self.result_shardings, self._output_specs)
        ]


def executable_call(executable, device, arguments: int) -> Callable[..., list] | None:
    """A function `(*arguments) -> [result arrays]` running `executable` on one `device`
    (a jax Device) through jax's C++ fast path, its arguments jax arrays on `device` or numpy
    arrays (put there by jax, in C++); None where this jax cannot build one."""
    try:
        from jax._src import tree_util
        from jax._src.interpreters import pxla
        from jax._src.lib import _jax
        from jax.sharding import SingleDeviceSharding

        sharding = SingleDeviceSharding(device)

        def cache_miss(*args):
            import jax

            stats["misses"] += 1
            arrays = [a if isinstance(a, jax.Array) else jax.device_put(a, sharding) for a in args]
            executed = executable.execute_sharded(arrays)
            results = [x[0] for x in executed.disassemble_into_single_device_arrays()]
            return results, _fastpath(executable, sharding, len(arrays), results), False

        return _jax.pjit(
            "tpu_inductor",
            lambda *args: cache_miss(*args)[0],  # what it calls with jax_disable_jit set
            cache_miss,
            [],
            [],
            pxla.JitGlobalCppCacheKeys(),
            tree_util.dispatch_registry,
            pxla.cc_shard_arg,
            _jax.PjitFunctionCache(capacity=4),
        )
    except (ImportError, AttributeError, TypeError) as e:
        _unavailable(repr(e))
        return None


def _fastpath(executable, sharding, arguments: int, results: list):
    """What jit's own cache miss hands its C++ fast path (None: call the miss every time)."""
    from jax._src import tree_util
    from jax._src.interpreters import pxla

    try:
        return pxla.MeshExecutableFastpathData(
            xla_executable=executable,
            out_pytree_def=tree_util.tree_structure([0] * len(results)),
            in_shardings=[sharding] * arguments,
            out_shardings=[r.sharding for r in results],
            out_avals=[r.aval for r in results],
            out_committed=[r._committed for r in results],
            kept_var_bitvec=[True] * arguments,  # every argument is kept (keep_unused)
            in_device_local_layouts=[None] * arguments,  # default layouts
            const_args=[],
        )
    except (AttributeError, TypeError) as e:  # another jax's fields
        _unavailable(repr(e))
        return None


@functools.cache
def _unavailable(reason: str) -> None:
    log.info("tpu_inductor: jax's C++ fast path is not available here (%s): Python execute", reason)
