"""How the OpInfo runner compares a sample's compiled outputs with eager's.

- Values within one tolerance table (per dtype), widened by an entry's own toleranceOverride
  only where torch sets it for the CPU (or any device) in a test class that measures accuracy
  (a CUDA Inductor override gave atanh an atol of 9e-3 here).
- Index outputs of sort-like ops are checked, not skipped: an unstable sort may order equal
  values differently from eager, so indices pass when the input gathered at them gives the
  values, and (sort, argsort, topk) a row's indices are distinct.
- 16-bit results that differ from eager pass when no less accurate than eager's against a
  float64 computation (torch._dynamo.utils.same's fp64 criterion); so do the float32 results of
  the few entries in FLOAT64_JUDGED, where eager's own float32 is not within the table's
  tolerance of its float64 result.
"""

from __future__ import annotations

import torch

from .outcome import Outcome

# Tolerances per dtype (one table): XLA may fuse and reassociate, so float32 is not bitwise.
TOLERANCES = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
    torch.float64: {"rtol": 1e-7, "atol": 1e-7},
    torch.complex64: {"rtol": 1e-4, "atol": 1e-5},  # complex results of float32 inputs (FFTs)
    torch.complex128: {"rtol": 1e-7, "atol": 1e-7},
}

# Test classes whose toleranceOverrides are about forward values against a reference.
ACCURACY_CLASSES = frozenset(
    {
        None,
        "TestCommon",
        "TestUnaryUfuncs",
        "TestBinaryUfuncs",
        "TestReductions",
        "TestDecomp",
        "TestInductorOpInfo",
        "TestEagerFusionOpInfo",
    }
)

# Dtypes compared against a float64 computation when they differ from eager.
LOW_PRECISION = (torch.bfloat16, torch.float16)

# Entries judged against float64 in float32 too: entry -> why eager's float32 is no reference.
FLOAT64_JUDGED = {
    "matrix_exp": "exp of a 5x5 sample with 1-norm ~27 (entries ~1e5): eager's own float32 is "
    "off its float64 by ~1e-6 of the largest entry, far past rtol 1e-4 on the small ones",
}

# Sort-like entries: the position of their dim argument, and whether their index output
# selects whole rows (whose indices are distinct) or one element per row.
INDEXED = {
    "sort": (0, True),
    "argsort": (0, True),
    "topk": (1, True),
    "kthvalue": (1, False),
    "median": (0, False),
    "nanmedian": (0, False),
    "mode": (0, False),
}
_EXACT = {"rtol": 0, "atol": 0}


def tolerance(op, dtype) -> dict:
    """Our tolerance for `dtype`, widened to the op's own CPU accuracy override if it has one."""
    from torch.testing._internal.common_device_type import toleranceOverride
    from torch.testing._internal.opinfo.core import DecorateInfo

    result = dict(TOLERANCES.get(dtype, {"rtol": 0, "atol": 0}))
    for info in op.decorators:
        if not isinstance(info, DecorateInfo):  # a bare decorator: every test and device
            info = DecorateInfo(info)
        if info.device_type not in (None, "cpu") or info.cls_name not in ACCURACY_CLASSES:
            continue
        if info.active_if is not True or (info.dtypes is not None and dtype not in info.dtypes):
            continue
        for decorator in info.decorators:
            if isinstance(decorator, toleranceOverride) and dtype in decorator.d:
                override = decorator.d[dtype]
                result["atol"] = max(result["atol"], override.atol)
                result["rtol"] = max(result["rtol"], override.rtol)
    return result


def compare(actual, expected, tol: dict) -> Outcome:
    """Every output within `tol` (integers and bools exactly)."""
    if len(actual) != len(expected):
        return Outcome("mismatch", f"{len(actual)} outputs, eager has {len(expected)}")
    for index, (got, want) in enumerate(zip(actual, expected)):
        exact = not (want.is_floating_point() or want.is_complex())
        # a float result of an integer or bool sample (cos of int64) has its own dtype's tolerance
        floor = TOLERANCES.get(want.dtype, tol)
        close = _EXACT if exact else {k: max(v, floor[k]) for k, v in tol.items()}
        try:
            torch.testing.assert_close(got, want, equal_nan=True, **close)
        except AssertionError as e:
            return Outcome("mismatch", f"output {index}: {' '.join(str(e).split())[:300]}")
    return Outcome("pass")


def compare_metadata(actual, expected) -> Outcome:
    got = [(tuple(t.shape), t.dtype) for t in actual]
    want = [(tuple(t.shape), t.dtype) for t in expected]
    if got != want:
        return Outcome("mismatch", f"shapes/dtypes {got}, eager {want}")
    return Outcome("random", "values not comparable; shapes and dtypes match")


def compare_indexed(name: str, case, actual, expected, tol: dict) -> Outcome:
    """A sort-like op's outputs, (values, indices) or argsort's indices: values as `compare`
    does them, indices by what they select from the input."""
    source, dim, rows = _layout(name, case)
    count = 1 if name == "argsort" else 2
    if source is None or len(expected) != count or len(actual) != count:
        return compare(actual, expected, tol)  # median() of a whole tensor: no indices
    direct = compare(actual[:-1], expected[:-1], tol)
    if direct.status != "pass":
        return direct
    got, want = actual[-1], expected[-1]
    if got.shape != want.shape or got.dtype != want.dtype:
        return Outcome("mismatch", f"indices {tuple(got.shape)} {got.dtype}, eager's {want}")
    if got.dim() < source.dim():  # a reduced dim (keepdim=False), or a 0-d input
        got, want = got.unsqueeze(dim), want.unsqueeze(dim)
    if bool(((got < 0) | (got >= source.shape[dim])).any()):
        return Outcome("mismatch", f"indices out of range for a dim of {source.shape[dim]}")
    picked = torch.take_along_dim(source, got, dim)
    reference = torch.take_along_dim(source, want, dim)  # eager's own selection
    if compare((picked,), (reference,), _EXACT).status != "pass":
        return Outcome("mismatch", "the input at the returned indices is not eager's values")
    if rows and bool((got.sort(dim).values.diff(dim=dim) == 0).any()):
        return Outcome("mismatch", "a row's indices repeat a position")
    return Outcome("pass")


def _layout(name: str, case):
    """(input, at least 1-d, or None; dim; whole rows) of a sort-like sample."""
    dim_at, rows = INDEXED[name]
    source = case.input
    dim = case.kwargs.get("dim", case.args[dim_at] if len(case.args) > dim_at else -1)
    if not isinstance(source, torch.Tensor) or not isinstance(dim, int):
        return None, 0, rows
    source = source.reshape(1) if source.dim() == 0 else source
    return source, dim % source.dim(), rows


def compare_to_float64(got, want, reference, direct: Outcome, tol: float = 2e-2) -> Outcome:
    """`direct` unless the result is no less accurate than eager's against a float64
    computation of the sample (`reference()`); `tol`: same()'s (2e-2 for 16-bit dtypes)."""
    from torch._dynamo.utils import same

    try:
        fp64 = reference()
    except Exception:
        return direct
    if len(fp64) == len(want) and same(want, got, fp64_ref=fp64, tol=tol, equal_nan=True):
        return Outcome("pass")
    return direct
