"""Bucket dispatch: the runtime half of shape bucketing (passes/bucket_shapes.py).

Per call of a bucketed graph: read each symbol's true size off the inputs, pick its bucket
(passes/bucket_policy.py), pad the inputs to the buckets, give SymInt inputs the bucket and the
true sizes as 0-d int inputs, run the executable of the padded signature (size_dispatch.SizeDispatch:
one compile per bucket), then slice every padded output back to its true sizes and give SymInt
outputs their true values. What each graph saw is kept for `report()` and the recompile
explanation: the buckets, the true sizes per bucket, and the padded share of the input work.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import math
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import sympy
import torch

from tpu_inductor.exc import OptionError
from tpu_inductor.passes import bucket_policy
from tpu_inductor.passes.bucket_shapes import BucketLayout
from tpu_inductor.runtime import size_dispatch
from tpu_inductor.runtime.residency import DeviceTensor

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BucketStats:
    """What one bucketed graph saw: per bucket (sizes per symbol), the true sizes it served."""

    name: str
    symbols: tuple[str, ...]
    served: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(set))
    real_elements: int = 0
    padded_elements: int = 0

    @property
    def padded_share(self) -> float:
        """The share of input elements that were padding, over every call."""
        total = self.real_elements + self.padded_elements
        return self.padded_elements / total if total else 0.0

    def as_dict(self) -> dict:
        return {
            "graph": self.name,
            "symbols": list(self.symbols),
            "buckets": {
                str(bucket): sorted(map(list, sizes)) for bucket, sizes in self.served.items()
            },
            "padded_share": round(self.padded_share, 4),
        }


_stats: list[BucketStats] = []


def report() -> list[dict]:
    """Every bucketed graph of this process: its buckets, the true sizes each served, and the
    padded share of the input elements."""
    return [s.as_dict() for s in _stats]


def clear_report() -> None:
    """Forget what the bucketed graphs so far saw (they keep running)."""
    _stats.clear()


def policy_of(shapes) -> bucket_policy.BucketPolicy:
    """The bucket policy of the `shapes` options record."""
    return bucket_policy.BucketPolicy(
        kind=shapes.policy,
        min_bucket=shapes.min_bucket,
        multiple=shapes.multiple,
        sizes=tuple(shapes.sizes),
    )


class BucketDispatch:
    """A boxed callable over a bucketed graph; `inner` runs the padded inputs (a SizeDispatch
    over the rewritten graph, its true-size inputs marked as values)."""

    def __init__(self, inner, layout: BucketLayout, shapes, observer):
        self._boxed_call = True
        self._inner = inner
        self._layout = layout
        self._policy = policy_of(shapes)
        self._plan = _plan(shapes) if shapes.policy == "auto" else None
        self._pad_with = shapes.pad_with
        self._observer = observer  # its records say which bucket and sizes asked for them
        self._keys = tuple(layout.keys[s] for s in layout.symbols)  # plan and record names
        self.stats = BucketStats(observer.name, self._keys)
        _stats.append(self.stats)

    def __call__(self, args: list) -> list:
        layout = self._layout
        true = true_sizes(layout, args)
        buckets = self._buckets(true)
        self.stats.served[tuple(buckets[s] for s in layout.symbols)].add(
            tuple(true[s] for s in layout.symbols)
        )
        stats, before = self.stats, (self.stats.real_elements, self.stats.padded_elements)
        padded = pad_inputs(layout, args, true, buckets, self._pad_with, stats)
        real, pad = stats.real_elements - before[0], stats.padded_elements - before[1]
        self._observer.bucketing = {
            "bucket": dict(zip(self._keys, buckets.values())),
            "true_sizes": dict(zip(self._keys, true.values())),
            "policy": self._policy.kind,
            "padded_share": round(pad / (real + pad), 4) if pad else 0.0,  # of this call's
        }
        return unpad_outputs(layout, self._inner(padded), true, buckets)

    def _buckets(self, true: dict[str, int]) -> dict[str, int]:
        """Each symbol's bucket for its true size: by the policy, or under "auto" by the plan
        (the graph's symbols' joint boundaries, else the symbol's), which counts the call."""
        symbols = self._layout.symbols
        policies = (self._policy,) * len(symbols)
        if self._plan is not None:
            self._plan.observe_call(self._keys, tuple(true[s] for s in symbols))
            policies = self._plan.policies_for(self._keys, self._policy)
        bounds = self._layout.bounds
        buckets = {
            s: max(policy.bucket(true[s], bounds.get(s)), true[s])
            for s, policy in zip(symbols, policies)
        }
        for read, at, k in self._layout.ties:  # a length and the same length plus k: one bucket
            shared, length = buckets[read] - k, true[at]  # >= length: buckets[read] >= true[read]
            if true[read] != length + k:
                continue
            for s in symbols:  # and every other symbol of that length (the other caches')
                bound = bounds.get(s)
                if true[s] == length and (bound is None or shared <= bound):
                    buckets[s] = shared
        return buckets


def true_sizes(layout: BucketLayout, args: list) -> dict[str, int]:
    """Each bucketed symbol's true size, read off the (unpadded) inputs."""
    sizes = {}
    for symbol in layout.symbols:
        position, dim = layout.sources[symbol]
        sizes[symbol] = int(args[position]) if dim is None else int(args[position].shape[dim])
    return sizes


def pad_inputs(layout: BucketLayout, args, true, buckets, pad_with: str, stats=None) -> list:
    """The graph's inputs at the `buckets`' sizes, then the true sizes of `layout.true_inputs`
    (ints); the padding filled as `pad_with` says; `stats` (a BucketStats) counts elements."""
    padded = list(args)
    for position, dim, factors in layout.padded_inputs:
        padded[position] = _pad(padded[position], dim, factors, true, buckets, pad_with, stats)
    for position, size in layout.size_inputs:
        padded[position] = _at(size, buckets)
    return padded + [true[s] for s in layout.true_inputs]


def unpad_outputs(layout: BucketLayout, outs, true, buckets) -> list:
    """The graph's outputs at the true sizes (padded dims sliced back, SymInts evaluated)."""
    return [_unpad(out, spec, true, buckets) for out, spec in zip(outs, layout.outputs)]


def _pad(tensor: torch.Tensor, dim: int, factors, true, buckets, pad_with, stats):
    """`tensor` with `dim` (row-major `factors`) padded at the end of each padded factor."""
    have = [_at(f, true) for f in factors]
    want = [_at(f, buckets) for f in factors]
    if have == want:
        return tensor
    if type(tensor) is DeviceTensor:  # a saved activation its bucketed forward kept padded
        padded = list(tensor.shape)
        padded[dim] = math.prod(want)
        if tensor.padded_shape == tuple(padded):
            return tensor.padded()
    merged = tensor.unflatten(dim, have) if len(factors) > 1 else tensor
    shape = list(merged.shape)
    shape[dim : dim + len(want)] = want
    out = torch.full(shape, _fill(tensor.dtype, pad_with), dtype=tensor.dtype)
    region = out
    for j, size in enumerate(have):
        region = region.narrow(dim + j, 0, size)
    region.copy_(merged)
    if stats is not None:
        stats.real_elements += tensor.numel()
        stats.padded_elements += out.numel() - tensor.numel()
    return out.flatten(dim, dim + len(factors) - 1) if len(factors) > 1 else out


def _unpad(out: Any, spec: Any, true: dict, buckets: dict) -> Any:
    if isinstance(spec, sympy.Expr):  # a SymInt output: its value at the true sizes
        return _at(spec, true)
    if spec is None or not isinstance(out, torch.Tensor):
        return out
    if type(out) is DeviceTensor:  # stays padded on the device; cut on the host if read
        shape = _unpad(torch.empty(out.shape, device="meta"), spec, true, buckets).shape
        return out.with_padding(shape, lambda host: _unpad(host, spec, true, buckets))
    for dim in reversed(range(len(spec))):
        factors = spec[dim]
        if not any(f.free_symbols for f in factors):
            continue
        if len(factors) == 1:
            out = out.narrow(dim, 0, _at(factors[0], true))
            continue
        out = out.unflatten(dim, [_at(f, buckets) for f in factors])
        for j, f in enumerate(factors):
            if f.free_symbols:
                out = out.narrow(dim + j, 0, _at(f, true))
        out = out.flatten(dim, dim + len(factors) - 1)
    return out.contiguous()  # as the graph's own outputs are


def _at(expr: sympy.Expr, sizes: dict) -> int:
    """A size expression's value where each symbol is `sizes[its name]` (every call: no sympy
    substitution on the per-call path, a function made once per expression)."""
    names, fn = _evaluator(expr)
    return int(fn(*(sizes[n] for n in names)))


@functools.cache
def _evaluator(expr: sympy.Expr):
    symbols = sorted(expr.free_symbols, key=str)
    return tuple(str(s) for s in symbols), sympy.lambdify(symbols, expr, "math")


def _fill(dtype: torch.dtype, pad_with: str):
    """What fills `dtype`'s padding: 0, or ("nan", "inf") NaN or +inf, True, the largest int."""
    if pad_with == "zeros":
        return 0
    if dtype.is_floating_point or dtype.is_complex:
        return float(pad_with)
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max


_plans: dict = {}


def _plan(shapes) -> bucket_policy.BucketPlan:
    """The `auto` plan of this process (one per plan file), loaded on first use."""
    key = shapes.plan
    if key not in _plans:
        _plans[key] = bucket_policy.BucketPlan.load(key) if key else bucket_policy.BucketPlan()
    return _plans[key]


def forget_plans() -> None:
    """Drop the plans of this process (the next use reads each file again)."""
    _plans.clear()


def save_plans(compile_cost: float = 0.0, max_buckets: int | None = None) -> list[str]:
    """Choose the `auto` policy's boundaries from every size seen so far and write each plan
    that has a file (option shapes.plan); returns their paths. A new process, or `tpu-inductor
    compile --plan`, given the same file buckets at these boundaries.

    Per symbol, and jointly for the symbols one graph's sizes come in (batch x length x ...):
    at most `max_buckets` buckets, jointly bucket tuples (default: as many as pow2 needs for
    the sizes seen, so never more compiles than pow2), the padded work least, plus
    `compile_cost` padded elements per bucket (raise it to trade padding for fewer compiles)."""
    saved = []
    for path, plan in _plans.items():
        plan.replan(max_buckets=max_buckets, compile_cost=compile_cost)
        if path:
            plan.save(path)
            saved.append(path)
    return saved


def precompile(
    compiled_fn,
    example_inputs,
    dims,
    largest,
    shapes=None,
    progress=None,
    *,
    workers: int | None = None,
    background: bool = False,
    backward: bool = False,
):
    """Compile every bucket of `compiled_fn` up front, for sizes 2..`largest` of the dims
    `dims` ({input position: dim}, one size) of `example_inputs`; returns the buckets called.
    Sizes that vary together: `dims` names each ({"B": {0: 0, 1: 0}, "S": {0: 1, 1: 1}}: the
    batch and the length of inputs 0 and 1), `largest` too ({"B": 8, "S": 512}); every
    combination of their buckets is called, and returned as {name: bucket}.

    Each bucket is one call at the bucket's size, the inputs cut or repeated along `dims` (under
    torch.no_grad: inference graphs; `backward=True`: with grad, and the backward of the sum of
    its float results for the module's parameters, no .grad written: training graphs).
    `shapes`: the options' `shapes` record (the policy's buckets; under "auto" with a plan, the
    boundaries it has for the dims, jointly where it has them, as a new process serving from
    the plan will use them); `progress(label)`, if given, is told each bucket as it starts.
    The buckets compile in `workers` threads (default: one per bucket, at most the CPUs and 8;
    1: one after another, on this thread unless in the background): their lowerings one at a
    time (Python), their PJRT compiles overlapping (they release the GIL). `background`: return
    once each bucket's first graph is handed to the threads; a call that needs a bucket still
    compiling waits for it, and precompile called again without `background` waits for all
    and checks them (graphs after a graph break compile then)."""
    from tpu_inductor.config import Options

    named = isinstance(largest, Mapping)
    groups = dims if named else {None: dims}
    tops = largest if named else {None: largest}
    if set(groups) != set(tops):
        raise OptionError(f"precompile: `dims` names {sorted(groups)}, `largest` {sorted(tops)}")
    policies = _group_policies(compiled_fn, groups, shapes or Options.from_user().shapes)
    per_group = [policies[g].buckets_up_to(tops[g]) for g in groups]
    calls = []
    for sizes in itertools.product(*per_group):
        inputs = list(example_inputs)
        resized = [(p, d, size) for g, size in zip(groups, sizes) for p, d in groups[g].items()]
        for position, dim, size in resized:
            inputs[position] = _resized(inputs[position], dim, size)
        for position, dim, _ in resized:  # marks on the final tensors (resizing makes new ones)
            torch._dynamo.maybe_mark_dynamic(inputs[position], dim)
        calls.append((dict(zip(groups, sizes)) if named else sizes[0], inputs))
    workers = workers or min(len(calls), os.cpu_count() or 1, 8)
    threads = workers > 1 or background  # in the background: one thread at least
    pool = ThreadPoolExecutor(workers, "tpu_inductor-precompile") if threads else None
    # A round calls every bucket; a call stops at the first graph it hands to the pool (the
    # graphs after a graph break are handed over in a later round, once their inputs exist).
    # The last round hands nothing over: every bucket ran, compiled.
    for round_ in itertools.count():
        ahead = pool is not None and round_ < _AHEAD_ROUNDS
        handed = _call_buckets(
            compiled_fn, calls, pool if ahead else None, progress, round_, backward
        )
        if (background and ahead) or not handed:
            break
    if pool is not None:
        pool.shutdown(wait=False)  # its compiles go on; the calls that need them wait
    return [bucket for bucket, _ in calls]


def _group_policies(compiled_fn, groups: dict, shapes) -> dict:
    """Each group of dims' policy: the options' policy, or under "auto" the plan's boundaries
    for the group's keys (a joint entry whose keys fall one in each group wins)."""
    policy = policy_of(shapes)
    if shapes.policy != "auto":
        return dict.fromkeys(groups, policy)
    plan = _plan(shapes)
    group_of = {k: g for g, members in groups.items() for k in _keys(compiled_fn, members)}
    for keys, chosen in plan.joint.items():
        if len({group_of.get(k) for k in keys} - {None}) == len(keys) == len(groups):
            return {
                group_of[k]: dataclasses.replace(policy, kind="auto", sizes=b)
                for k, b in zip(keys, chosen)
            }
    out = {}
    for group, members in groups.items():
        keys = [k for k in _keys(compiled_fn, members) if plan.boundaries.get(k)]
        out[group] = plan.policy_for(keys[0], policy) if keys else policy
    return out


_AHEAD_ROUNDS = 8  # graph breaks deeper than this compile the rest one after another


def _call_buckets(compiled_fn, calls, pool, progress, round_: int, backward: bool) -> bool:
    """Call `compiled_fn` at each bucket's inputs (with `pool`, inside
    size_dispatch.compiling_ahead); whether a call handed a compile to the pool."""
    handed = False
    ahead = size_dispatch.compiling_ahead(pool) if pool is not None else contextlib.nullcontext()
    with ahead, torch.set_grad_enabled(backward):
        for bucket, inputs in calls:
            if progress is not None and round_ == 0:
                progress(f"bucket {bucket}")
            try:
                out = compiled_fn(*inputs)
                if backward:
                    _gradients(compiled_fn, inputs, out)
            except size_dispatch.CompilingAhead:
                handed = True
    return handed


def _gradients(compiled_fn, inputs, out) -> None:
    """Run the backward of `out`'s float results (their sum) for the parameters of
    `compiled_fn` (a module) and the inputs that require grad, leaving every .grad alone."""
    module = getattr(compiled_fn, "_orig_mod", compiled_fn)
    params = list(module.parameters()) if isinstance(module, torch.nn.Module) else []
    leaves = [t for t in (*params, *inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    results = [
        t
        for t in torch.utils._pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    if not results or not leaves:
        raise OptionError(
            "precompile(backward=True): no result of the call needs a gradient (of "
            f"{len(leaves)} parameters and inputs that require grad): nothing to compile"
        )
    torch.autograd.grad(sum(t.float().sum() for t in results), leaves, allow_unused=True)


def _keys(compiled_fn, dims) -> list[str]:
    """The plan keys Dynamo gives the sizes of `dims` ({position: dim}) of `compiled_fn`'s
    inputs: `L['x'].size()[1]` for dim 1 of its argument `x` (a module's: its forward's)."""
    fn = getattr(compiled_fn, "_orig_mod", None) or getattr(
        compiled_fn, "_torchdynamo_orig_callable", compiled_fn
    )
    fn = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # no signature to read: the policy's buckets
        return []
    return [f"L[{names[p]!r}].size()[{d}]" for p, d in dims.items() if p < len(names)]


def _resized(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`tensor` cut to, or repeated up to, `size` along `dim`."""
    reps = -(-size // tensor.shape[dim])
    repeats = [1] * tensor.dim()
    repeats[dim] = reps
    return tensor.repeat(*repeats).narrow(dim, 0, size).contiguous()
