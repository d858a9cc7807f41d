"""tpu_inductor: a torch.compile backend that runs PyTorch programs on any PJRT device.

    torch.compile(model, backend="tpu_inductor")

Importing this package is cheap and changes no global state; jax is imported on first compile.
"""

from tpu_inductor.version import __version__

__all__ = [
    "Mesh",
    "__version__",
    "auto_mesh",
    "compiles",
    "enable_flex_attention_training",
    "load_checkpoint",
    "mark_sharding",
    "materialize",
    "memory",
    "no_compiles",
    "precompile",
    "profile",
    "register_lowering",
    "reset_memory_peak",
    "reset_transfers",
    "save_checkpoint",
    "save_plans",
    "shard",
    "shard_optimizer_state",
    "sharding_plans",
    "sync",
    "transfers",
]

# Sharding's user API (tpu_inductor.sharding.shard), imported when first used; `shard` and
# `shard_optimizer_state` also move the state onto the mesh's devices (state.device_state).
_SHARDING = ("Mesh", "mark_sharding")


def __getattr__(name: str):
    import importlib

    if name in _SHARDING:
        return getattr(importlib.import_module(".sharding.shard", __name__), name)
    if name in ("shard", "shard_optimizer_state"):
        return getattr(importlib.import_module(".state.device_state", __name__), name)
    if name == "materialize":  # a model built on meta, made on the mesh (state.materialize)
        return importlib.import_module(".state.materialize", __name__).materialize
    if name in ("save_checkpoint", "load_checkpoint"):  # sharded, without gathering
        return getattr(importlib.import_module(".state.checkpoint", __name__), name)
    if name == "profile":  # `with tpu_inductor.profile(dir):` a trace and a table per graph
        return importlib.import_module(".tune.profile", __name__).profile
    if name == "enable_flex_attention_training":  # FlexAttention's backward on host tensors
        return importlib.import_module(
            ".ops.flex_attention", __name__
        ).enable_flex_attention_training
    if name == "auto_mesh":  # the tuned config's mesh, else the one given (sharding.named)
        return importlib.import_module(".sharding.named", __name__).auto_mesh
    if name == "sharding_plans":
        return importlib.import_module(".sharding.plans", __name__)
    if name == "distributed":  # tpu_inductor.distributed.initialize(...): several hosts
        return importlib.import_module(".sharding.distributed", __name__)
    raise AttributeError(f"module 'tpu_inductor' has no attribute {name!r}")


def compiles() -> int:
    """PJRT compiles in this process so far: a serving loop asserts that none came after
    warm-up (on a TPU each costs seconds to minutes)."""
    from tpu_inductor.runtime.devices import stats

    return stats["pjrt_compiles"]


def register_lowering(op, *, needs_ctx: bool = False, supports=None):
    """Lower `op` (a torch.library custom op: "namespace::op", "namespace::op.overload" or the
    op object) with the decorated jax function of its tensors (jax arrays) and other arguments,
    `fn(ctx, ...)` with `needs_ctx` (ctx.out_dtype, ctx.out_shape: the node's result);
    `supports(node)` may decline some calls. An op defined later is found by its name. The
    rule's source is in the compile cache's key. Guide: docs/extending.md, "Lowering a custom
    op"."""
    from tpu_inductor.lowering import register_user_lowering

    return register_user_lowering(op, needs_ctx=needs_ctx, supports=supports)


def precompile(
    compiled_fn, example_inputs, dims, largest, shapes=None, progress=None, **how
) -> list[int]:
    """Compile every shape bucket of `compiled_fn` up front, in parallel (`workers=`), or in
    the background (`background=True`): tpu_inductor.runtime.buckets.precompile."""
    from tpu_inductor.runtime.buckets import precompile as run

    return run(compiled_fn, example_inputs, dims, largest, shapes, progress, **how)


def no_compiles():
    """A context manager: a compile inside it (this thread) raises UnexpectedCompileError, so a
    serving loop proves that warm-up left nothing to compile (tpu_inductor.runtime.size_dispatch)."""
    from tpu_inductor.runtime.size_dispatch import no_compiles as block

    return block()


def save_plans() -> list[str]:
    """Write the `auto` bucket plans chosen from the sizes seen (tpu_inductor.runtime.buckets)."""
    from tpu_inductor.runtime.buckets import save_plans as run

    return run()


def sync(*objects) -> int:
    """Bring host copies left stale under options={"host_sync": "explicit"} up to date: every
    one, or those of the given tensors, modules (their parameters, gradients and buffers) and
    optimizers (their state). Returns the bytes copied from the device (ledger kind "synced")."""
    from tpu_inductor.runtime.host_sync import sync_objects

    return sync_objects(objects)


def transfers() -> dict:
    """Bytes moved between host and device in this process, by direction and kind (counted as
    an accelerator pays them, also on the zero-copy CPU): tpu_inductor.transfers."""
    from tpu_inductor.runtime.ledger import transfers as ledger

    return ledger()


def reset_transfers() -> None:
    """Count transfers from zero again (a benchmark's steady state, a test)."""
    from tpu_inductor.runtime.ledger import reset

    reset()


def memory() -> dict:
    """What this process holds, now: per device, the bytes of the device arrays the runtime
    keeps by kind (parameters, optimizer_state, gradients, hoisted, saved, buffers, mirrors,
    unreachable, and their total); per compiled executable, XLA's memory analysis (argument,
    temporary, output, alias and generated-code bytes per device) and what a call needs beyond
    the resident state; per device, a peak estimate (resident bytes plus the largest need of
    the executables run since `reset_memory_peak()`); and `host_held`, the host bytes still
    held by tensors whose current values are on the devices (storages left stale under
    host_sync="explicit", by kind; host copies of device tensors eager code read), kept apart
    from the device bytes even on the CPU. A plain dict: tpu_inductor.runtime.memory."""
    from tpu_inductor.runtime.memory import memory as ledger

    return ledger()


def reset_memory_peak() -> None:
    """Start the peak estimate of `memory()` again: only executables run after this count."""
    from tpu_inductor.runtime.memory import reset_peak

    reset_peak()
