"""Buckets of an AOT artifact: which bucket serves a call, and padded buckets.

`--bucket S=16,32,64` serves every S from 2 to 64; `--plan FILE` takes the buckets of an `auto`
bucket plan saved by torch.compile runs (`buckets_from_plan`). The dims that `--bucket` names are exported
once with symbolic sizes (torch.export's Dim, at most the largest bucket), and the shape pass
(passes/bucket_shapes.py) rewrites that one graph so an executable compiled at a bucket's sizes
is exact at every size up to them: the true sizes are extra 0-d int inputs, and every op that
reads across padding masks it. At a call each dim's size picks the smallest bucket holding it;
tpu_inductor/runtime/buckets.py pads the inputs and slices the outputs back, as it does under
torch.compile. A size above a dim's largest bucket is an InputMismatchError that names the dim,
the size and the largest bucket.

Compiled at their exact sizes instead, as before, with the reason in the manifest's `padding`:
combinations with a bucket of 0 or 1 (torch specializes those sizes: exact entries beside the
padded ones), a model torch.export cannot export with symbolic sizes, a graph the pass cannot
prove exact, an artifact split over a mesh. The manifest's `padding` is null (no named dims),
{"refused": why}, or {"layout": the BucketLayout as JSON, "dims": {symbol: dim name}}; each
entry says whether it is `padded`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sympy
import torch

from tpu_inductor.cache import serialize
from tpu_inductor.exc import InputMismatchError, OptionError
from tpu_inductor.passes.bucket_policy import BucketPlan
from tpu_inductor.passes.bucket_shapes import BucketLayout
from tpu_inductor.runtime import buckets as bucketing

SMALLEST = 2  # the smallest size a padded bucket serves: torch specializes sizes 0 and 1


# ---------------------------------------------------------------------------------------------
# compile


def buckets_from_plan(path, inputs: Sequence) -> dict[str, tuple[int, ...]]:
    """`--plan FILE`: each named dim's buckets from an `auto` bucket plan (tpu_inductor.
    save_plans): the boundaries chosen for the input's dim under torch.compile (its key,
    `L['ids'].size()[1]` for the dim 1 of input `ids`), joint boundaries (2+ keys) over each key's
    own; dims that share a name take every one of their boundaries. The plan's buckets are the
    artifact's: a size above the largest is refused, as with --bucket. Dims the plan has no
    boundaries for are left out; a plan with none for any named dim is an OptionError."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"the bucket plan {path} does not exist")
    plan = BucketPlan.load(path)
    keys = {
        f"L[{spec.name!r}].size()[{i}]": dim
        for spec in inputs
        for i, dim in enumerate(spec.shape)
        if isinstance(dim, str)
    }
    joint = {
        key: sizes
        for pair, chosen in plan.joint.items()
        if set(pair) <= set(keys)
        for key, sizes in zip(pair, chosen)
    }
    found: dict[str, set[int]] = {}
    for key, dim in keys.items():
        sizes = joint.get(key) or plan.boundaries.get(key, ())
        if sizes:
            found.setdefault(dim, set()).update(sizes)
    if keys and not found:
        known = sorted({*plan.boundaries, *(k for pair in plan.joint for k in pair)})
        raise OptionError(
            f"tpu-inductor: the bucket plan {path} has no boundaries for the named dims "
            f"{sorted(keys)} (it has {known or 'none'}): save it (tpu_inductor.save_plans()) "
            "after running the model under torch.compile with these input names, or give --bucket."
        )
    return {dim: tuple(sorted(sizes)) for dim, sizes in found.items()}


def padded_sizes(buckets: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Per named dim, its buckets a padded graph serves (>= SMALLEST); {} if a dim has none."""
    padded = {name: tuple(sorted(s for s in v if s >= SMALLEST)) for name, v in buckets.items()}
    return padded if padded and all(padded.values()) else {}


def is_padded(sizes: dict[str, int], padded: dict[str, tuple[int, ...]]) -> bool:
    """Whether the padded graph serves a combination of bucket sizes."""
    return bool(padded) and all(sizes[name] in padded[name] for name in sizes)


def dynamic_shapes(inputs: Sequence, padded: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """torch.export's `dynamic_shapes` for `inputs`: each named dim a Dim up to its largest
    bucket."""
    dims = {name: torch.export.Dim(name, min=SMALLEST, max=max(v)) for name, v in padded.items()}
    return {
        spec.name: {i: dims[d] for i, d in enumerate(spec.shape) if isinstance(d, str)} or None
        for spec in inputs
    }


def describe(layout: BucketLayout, graph_inputs: list, inputs: Sequence) -> dict:
    """The manifest's `padding` of a bucketed graph: its layout and each symbol's dim name."""
    shapes = {spec.name: spec.shape for spec in inputs}
    dims = {}
    for symbol in layout.symbols:
        position, dim = layout.sources[symbol]
        named = shapes[graph_inputs[position]["input"]][dim] if dim is not None else None
        if not isinstance(named, str):  # export makes symbols only of the named dims
            raise ValueError(f"symbol {symbol} is not the size of a named dim")
        dims[symbol] = named
    return {"layout": _layout_json(layout), "dims": dims}


def true_size_inputs(padding: dict, sizes: dict[str, int]) -> list[torch.Tensor]:
    """The true-size inputs of a padded graph at a bucket's own `sizes` (to compile it)."""
    layout = padding["layout"]
    return [torch.tensor(sizes[padding["dims"][s]]) for s in layout["true_inputs"]]


def _layout_json(layout: BucketLayout) -> dict:
    def factors(fs):
        return [str(f) for f in fs]

    def output(spec):
        if spec is None:
            return None
        if isinstance(spec, sympy.Expr):
            return {"size": str(spec)}
        return {"dims": [factors(fs) for fs in spec]}

    return {
        "symbols": list(layout.symbols),
        "sources": {s: list(src) for s, src in layout.sources.items()},
        "padded_inputs": [[p, d, factors(fs)] for p, d, fs in layout.padded_inputs],
        "size_inputs": [[p, str(e)] for p, e in layout.size_inputs],
        "true_inputs": list(layout.true_inputs),
        "outputs": [output(spec) for spec in layout.outputs],
    }


def layout_of(padding: dict) -> BucketLayout:
    """The BucketLayout a manifest's `padding` describes (KeyError, ValueError, TypeError or
    sympy's SympifyError if it is malformed)."""
    data = padding["layout"]
    names = {s: sympy.Symbol(s, integer=True, positive=True) for s in data["symbols"]}

    def expr(text: str) -> sympy.Expr:
        value = sympy.sympify(text, locals=names)
        if not isinstance(value, sympy.Expr) or not value.free_symbols <= set(names.values()):
            raise ValueError(f"size {text!r} is not an expression of {sorted(names)}")
        return value

    def output(spec):
        if spec is None:
            return None
        if "size" in spec:
            return expr(spec["size"])
        return tuple(tuple(map(expr, fs)) for fs in spec["dims"])

    symbols = tuple(data["symbols"])
    if set(padding["dims"]) != set(symbols):
        raise ValueError("padding.dims does not name a dim for every symbol")
    return BucketLayout(
        symbols=symbols,
        sources={
            s: (int(p), None if d is None else int(d)) for s, (p, d) in data["sources"].items()
        },
        padded_inputs=tuple(
            (int(p), int(d), tuple(map(expr, fs))) for p, d, fs in data["padded_inputs"]
        ),
        size_inputs=tuple((int(p), expr(e)) for p, e in data["size_inputs"]),
        true_inputs=tuple(data["true_inputs"]),
        outputs=tuple(output(spec) for spec in data["outputs"]),
        bounds={},
        keys={s: padding["dims"][s] for s in symbols},
    )


# ---------------------------------------------------------------------------------------------
# call


class Selector:
    """Which entry of an artifact serves a call; for a padded entry, its padding and unpadding.

    `inputs`: the artifact's InputSpecs; `manifest`: its checked manifest."""

    def __init__(self, inputs: Sequence, manifest: dict, directory):
        self.inputs = inputs
        self.entries = manifest["entries"]
        self.buckets = manifest["buckets"]
        self.directory = directory
        padding = manifest.get("padding") or {}
        self.layout = layout_of(padding) if "layout" in padding else None
        self.dims = padding.get("dims", {})
        self.refused = padding.get("refused")

    def entry_of(self, values: dict[str, torch.Tensor]) -> int:
        """The number of the entry that serves `values` (InputMismatchError if none does): an
        exact entry of their sizes, else the padded entry of the smallest buckets holding them."""
        for number, entry in enumerate(self.entries):
            if not entry.get("padded") and self._all_match(values, entry["sizes"]):
                return number
        sizes = self._named_sizes(values)
        if self.layout is not None and sizes is not None:
            want = {dim: self._bucket(dim, size) for dim, size in sizes.items()}
            for number, entry in enumerate(self.entries):
                if entry.get("padded") and entry["sizes"] == want:
                    if self._all_match(values, sizes):
                        return number
                    break
        raise InputMismatchError(self._mismatch(values, sizes))

    def run(self, compiled, flat: list, sizes: dict[str, int], pad_with: str) -> list:
        """`compiled` (a padded entry at bucket `sizes`) on the true inputs `flat`: padded, the
        true sizes appended, its outputs sliced back."""
        layout = self.layout
        true = bucketing.true_sizes(layout, flat)
        buckets = {s: sizes[self.dims[s]] for s in layout.symbols}
        padded = bucketing.pad_inputs(layout, flat, true, buckets, pad_with)
        padded[len(flat) :] = [torch.tensor(n) for n in padded[len(flat) :]]
        return bucketing.unpad_outputs(layout, compiled(padded), true, buckets)

    def _bucket(self, dim: str, size: int) -> int:
        padded = [e["sizes"][dim] for e in self.entries if e.get("padded")]
        largest = max(padded)
        if size > largest:
            raise InputMismatchError(
                f"tpu_inductor: dim {dim!r} is {size}, above its largest bucket {dim}={largest} "
                f"of the artifact {self.directory} (it serves {SMALLEST} to {largest}). "
                f"Recompile with a larger bucket, e.g. --bucket {dim}=...,{_next_pow2(size)}."
            )
        if size < SMALLEST:
            raise InputMismatchError(
                f"tpu_inductor: dim {dim!r} is {size}; padded buckets serve sizes from "
                f"{SMALLEST} (torch specializes 0 and 1) and no bucket of exactly {dim}={size} "
                f"was compiled into {self.directory}. Recompile with --bucket {dim}={size},..."
            )
        return min(s for s in padded if s >= size)

    def _all_match(self, values, sizes: dict[str, int]) -> bool:
        return all(_matches(values[s.name], s, sizes) for s in self.inputs)

    def _named_sizes(self, values) -> dict[str, int] | None:
        """Each named dim's size in `values`; None if inputs disagree or are not tensors."""
        sizes: dict[str, int] = {}
        for spec in self.inputs:
            value = values[spec.name]
            if not isinstance(value, torch.Tensor) or value.dim() != len(spec.shape):
                return None
            for dim, size in zip(spec.shape, value.shape):
                if isinstance(dim, str) and sizes.setdefault(dim, size) != size:
                    return None
        return sizes

    def _mismatch(self, values, sizes) -> str:
        if sizes is None and self._disagree(values):
            return self._disagree(values)
        spec = next(
            s
            for s in self.inputs
            if not any(_matches(values[s.name], s, e["sizes"]) for e in self._shown(sizes))
        )
        got = values[spec.name]
        actual = (
            f"{serialize.dtype_name(got.dtype)}{list(got.shape)}"
            if isinstance(got, torch.Tensor)
            else type(got).__name__
        )
        expected = " or ".join(
            dict.fromkeys(
                f"{serialize.dtype_name(spec.dtype)}{list(spec.concrete(e['sizes']))}"
                for e in self._shown(sizes)
            )
        )
        padded = f" (named dims padded up to: {self._served()})" if self.layout else ""
        refused = f" Buckets are exact sizes only: {self.refused}." if self.refused else ""
        return (
            f"tpu_inductor: input {spec.name!r} expected {expected}{padded} (spec {spec}), got "
            f"{actual}. Pass a matching tensor, or recompile with the shapes you need "
            f"(--bucket).{refused}"
        )

    def _shown(self, sizes) -> list[dict]:
        """The entries an error lists: the exact ones, and a padded one at the true sizes."""
        shown = [e for e in self.entries if not e.get("padded")]
        if self.layout is not None and sizes:
            shown.append({"sizes": sizes})
        return shown or self.entries

    def _served(self) -> str:
        padded = [e["sizes"] for e in self.entries if e.get("padded")]
        return " ".join(f"{d}<={max(s[d] for s in padded)}" for d in padded[0]) if padded else ""

    def _disagree(self, values) -> str | None:
        """Which inputs give a named dim different sizes, described; None if they agree."""
        seen: dict[str, dict[str, int]] = {}
        for spec in self.inputs:
            value = values[spec.name]
            for dim, size in zip(spec.shape, getattr(value, "shape", ())):
                if isinstance(dim, str):
                    seen.setdefault(dim, {})[spec.name] = size
        buckets = " ".join(f"{k}={','.join(map(str, v))}" for k, v in self.buckets.items())
        for dim, sizes in seen.items():
            if len(set(sizes.values())) > 1:
                has = ", ".join(f"{name!r} has {dim}={size}" for name, size in sizes.items())
                return (
                    f"tpu_inductor: inputs disagree on dim {dim!r}: {has}. Inputs that share a "
                    f"dim must have the same size in it (compiled buckets: {buckets})."
                )
        return None


def _matches(value, spec, sizes: dict[str, int]) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == spec.dtype
        and tuple(value.shape) == spec.concrete(sizes)
    )


def _next_pow2(size: int) -> int:
    return 1 << (size - 1).bit_length()


def padding_problem(manifest: dict) -> str | None:
    """What is wrong with a manifest's `padding` and its padded entries, described; None if
    sound."""
    padding = manifest.get("padding")
    padded = [e for e in manifest["entries"] if e.get("padded")]
    if padding is not None and not isinstance(padding, dict):
        return f"field 'padding' is {padding!r:.60}, expected an object or null"
    if padded and "layout" not in (padding or {}):
        return "entries are padded but field 'padding' has no layout"
    if padded:
        try:
            layout_of(padding)
        except (KeyError, ValueError, TypeError, sympy.SympifyError) as e:
            return f"field 'padding' is malformed ({type(e).__name__}: {e})"
    return None
