"""Run OpInfo samples through our lowering and PJRT, and compare with eager PyTorch.

For one (OpInfo entry, dtype): the first N samples are traced together into one functional
core-ATen graph (make_fx over functionalize, fake tensors), compiled with fallback="error"
(every op lowered by us, none run in eager), executed on real inputs and compared with eager.

    python -m tests.opinfo.runner [--dtypes float32,bfloat16] [--samples 3] [--out report.md]

writes the coverage report (`make opinfo`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import itertools
import json
import sys
import time

import torch
from torch.utils import _pytree as pytree

from . import compare, randomness
from .outcome import Outcome, entry_name

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "bool": torch.bool,
}

# Statuses: "pass" | "random" (nondeterministic: shapes and dtypes match) | "mismatch" (a wrong answer: never acceptable) | "unsupported" (an op has no
# rule) | "lowering_error" | "untraceable" (data-dependent shapes etc.: Dynamo graph-breaks and
# eager runs it) | "eager_error" (eager torch rejects the sample) | "no_samples".


@functools.cache
def op_db() -> list:
    from torch.testing._internal.common_methods_invocations import op_db as db

    return list(db)


def _decompositions():
    from tpu_inductor import decompositions

    return decompositions.table()


def run_entry(op, dtype: torch.dtype, samples: int = 3, baseline: str | None = None) -> Outcome:
    """Outcome of one OpInfo entry at one dtype.

    `baseline="inductor"` runs the same samples through torch.compile's default Inductor
    instead (the reference the coverage target is measured against).
    """
    from functorch.compile import aot_function

    from tpu_inductor.compile_fx import compile_graph
    from tpu_inductor.config import Options
    from tpu_inductor.exc import UnsupportedOpError

    if dtype not in op.supported_dtypes("cpu"):
        return Outcome("no_samples", "dtype not supported by the op")
    torch.manual_seed(0)
    try:
        cases = list(itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=False), samples))
    except Exception as e:  # a sample generator that fails on this build
        return Outcome("eager_error", f"sample_inputs: {type(e).__name__}: {e}")
    if not cases:
        return Outcome("no_samples")
    leaves, specs = [], []
    for case in cases:
        flat, spec = pytree.tree_flatten((case.input, case.args, case.kwargs))
        leaves.append(flat)
        specs.append(spec)
    tensor_slots = [
        (i, j)
        for i, flat in enumerate(leaves)
        for j, v in enumerate(flat)
        if isinstance(v, torch.Tensor)
    ]
    tensors = [leaves[i][j] for i, j in tensor_slots]

    def fn(*args):
        rebuilt = [list(flat) for flat in leaves]
        for (i, j), value in zip(tensor_slots, args):
            rebuilt[i][j] = value
        outs = []
        for flat, spec in zip(rebuilt, specs):
            inp, a, kw = pytree.tree_unflatten(flat, spec)
            result = pytree.tree_leaves(op.op(inp, *a, **kw))
            outs.append(tuple(v for v in result if isinstance(v, torch.Tensor)))
        counts[:] = [len(o) for o in outs]
        return tuple(v for o in outs for v in o)

    counts: list[int] = []

    def reference(case):
        """The sample computed in float64 (floating tensors upcast), or None if it can't be."""
        up = pytree.tree_map(
            lambda v: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v,
            (case.input, case.args, case.kwargs),
        )
        result = pytree.tree_leaves(op.op(up[0], *up[1], **up[2]))
        return tuple(v for v in result if isinstance(v, torch.Tensor))

    try:
        expected = fn(*[t.clone() for t in tensors])
    except Exception as e:
        return Outcome("eager_error", f"{type(e).__name__}: {str(e)[:200]}")
    options = Options.from_user({"fallback": "error"})
    traced: list[str] = []

    def compiler(gm, example_inputs):
        traced.append("ok")
        return compile_graph(gm, example_inputs, options)

    # The backend's own path minus Dynamo: AOTAutograd (functionalize + core ATen) → our compiler.
    if baseline:
        torch._dynamo.reset()  # a fresh Dynamo per entry: `fn` is one code object for all of them
    compiled = (
        torch.compile(fn, backend=baseline, fullgraph=False)
        if baseline
        else aot_function(
            fn,
            fw_compiler=compiler,
            decompositions=_decompositions(),
            keep_inference_input_mutations=True,
        )
    )
    try:
        with torch.no_grad(), torch._functorch.config.patch(unlift_effect_tokens=True):
            actual = compiled(*[t.clone() for t in tensors])
    except UnsupportedOpError as e:
        missing = sorted(
            {line.split()[0] for line in str(e).splitlines()[1:] if line.startswith("  ")}
        )
        return Outcome("unsupported", " ".join(missing))
    except Exception as e:
        status = "lowering_error" if traced else "untraceable"
        return Outcome(status, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    name = entry_name(op)
    tol = compare.tolerance(op, dtype)
    outcomes, start = [], 0
    for case, count in zip(cases, counts):
        got, want = actual[start : start + count], expected[start : start + count]
        start += count
        if randomness.draws(name, case):
            outcomes.append(compare.compare_metadata(got, want))
            continue
        if name in compare.INDEXED:
            outcome = compare.compare_indexed(name, case, got, want, tol)
        else:
            outcome = compare.compare(got, want, tol)
        if outcome.status == "mismatch" and dtype in compare.LOW_PRECISION:
            outcome = compare.compare_to_float64(
                got, want, functools.partial(reference, case), outcome
            )
        elif outcome.status == "mismatch" and name in compare.FLOAT64_JUDGED:
            outcome = compare.compare_to_float64(
                got, want, functools.partial(reference, case), outcome, tol=tol["rtol"]
            )
        outcomes.append(outcome)
    failed = [o for o in outcomes if o.status == "mismatch"]
    if failed:
        return failed[0]
    return outcomes[0] if all(o.status == "random" for o in outcomes) else Outcome("pass")


def run_all(dtypes, samples: int, names=None, progress=None, baseline=None) -> dict:
    """{(entry, dtype name): Outcome} over op_db (or the entries named)."""
    results = {}
    for op in op_db():
        name = entry_name(op)
        if names and name not in names:
            continue
        for dtype_name in dtypes:
            results[(name, dtype_name)] = run_entry(op, DTYPES[dtype_name], samples, baseline)
            if progress:
                progress(name, dtype_name, results[(name, dtype_name)])
    return results


def report(results: dict, dtypes) -> str:
    """The markdown coverage report of a run."""
    lines = ["# OpInfo coverage (tpu_inductor lowering, fallback disabled)", ""]
    lines.append(
        "| dtype | pass | random | mismatch | unsupported | lowering_error | untraceable | eager_error | entries with samples |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for dtype_name in dtypes:
        counts = collections.Counter(o.status for (n, d), o in results.items() if d == dtype_name)
        with_samples = sum(v for k, v in counts.items() if k not in ("no_samples", "eager_error"))
        lines.append(
            f"| {dtype_name} | {counts['pass']} | {counts['random']} | {counts['mismatch']} | {counts['unsupported']} | "
            f"{counts['lowering_error']} | {counts['untraceable']} | {counts['eager_error']} | {with_samples} |"
        )
    missing = collections.Counter()
    for outcome in results.values():
        if outcome.status == "unsupported":
            missing.update(outcome.detail.split())
    lines += ["", "## Ops without a rule, by the number of entries they block", ""]
    lines += [f"- {op}: {count}" for op, count in missing.most_common()]
    lines += ["", "## Entries not passing", ""]
    for (name, dtype_name), outcome in sorted(results.items()):
        if outcome.status not in ("pass", "no_samples"):
            lines.append(f"- {name} [{dtype_name}] {outcome.status}: {outcome.detail}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtypes", default="float32,bfloat16,int64,bool")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated entry names")
    parser.add_argument("--out", default="opinfo-report.md")
    parser.add_argument("--json", default=None)
    parser.add_argument("--baseline", default=None, help="e.g. inductor: run that backend instead")
    parser.add_argument("--from-json", default=None, help="rebuild outputs from a --json run")
    parser.add_argument("--write-expected", action="store_true", help="rewrite expected.py")
    args = parser.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    start = time.time()
    done = itertools.count(1)

    def progress(name, dtype_name, outcome):
        print(
            f"\r{next(done)} {name} [{dtype_name}] {outcome.status}".ljust(70),
            end="",
            file=sys.stderr,
        )

    if args.from_json:
        with open(args.from_json) as f:
            raw = json.load(f)
        results = {tuple(k.split("|")): Outcome(**v) for k, v in raw.items()}
    else:
        names = set(filter(None, args.only.split(",")))
        results = run_all(dtypes, args.samples, names, progress, args.baseline)
    if args.write_expected:
        path = __file__.replace("runner.py", "expected.py")
        with open(path, "w") as f:
            f.write(expected_table(results))
    text = report(results, dtypes)
    with open(args.out, "w") as f:
        f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {f"{n}|{d}": dataclasses.asdict(o) for (n, d), o in results.items()}, f, indent=1
            )
    print(
        f"\n{text.split('## Ops')[0]}\nwrote {args.out} in {time.time() - start:.0f}s",
        file=sys.stderr,
    )
    return 0


_REASON_PREFIX = {
    "unsupported": "no lowering rule yet for",
    "untraceable": "data-dependent shapes or values, Dynamo graph-breaks and eager runs it:",
    "eager_error": "eager torch rejects the sample on this machine:",
    "lowering_error": "lowering fails:",
}


def expected_table(results: dict) -> str:
    """tests/opinfo/expected.py's text for a full run: each failing entry with its reason."""
    table: dict[str, dict[str, tuple[str, str]]] = {}
    for (name, dtype_name), outcome in sorted(results.items()):
        if outcome.status in _REASON_PREFIX:
            reason = f"{_REASON_PREFIX[outcome.status]} {outcome.detail}".strip()
            table.setdefault(name, {})[dtype_name] = (outcome.status, reason)
    lines = [
        '"""Expected OpInfo failures: entry → dtype → (status, reason). Generated by',
        "`python -m tests.opinfo.runner --write-expected` from a full run; edit reasons by hand.",
        '"""',
        "",
        "EXPECTED: dict[str, dict[str, tuple[str, str]]] = {",
    ]
    for name, by_dtype in table.items():
        lines.append(f"    {name!r}: {{")
        for dtype_name, (status, reason) in by_dtype.items():
            lines.append(f"        {dtype_name!r}: ({status!r}, {reason!r}),")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
