"""Indexing rules against eager torch: advanced indexing, gather/scatter, index_*, masks, sorting.

Ops with data-dependent output shapes (nonzero, masked_select, x[mask]) have no lowering: a graph
that holds one runs them in eager torch, or raises UnsupportedOpError under fallback="error".
"""

from __future__ import annotations

import pytest
import torch
from tpu_inductor.lowering import registry

from tests.helpers import check_against_eager, compile_aten
from tpu_inductor.exc import UnsupportedOpError


def _x(*shape, dtype=torch.float32):
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    return torch.randint(-50, 50, shape, dtype=dtype)


def _perm_index(n, dims, d, dtype=torch.int64):
    """A permutation of range(n) along dim d, broadcast over `dims` (no duplicate targets)."""
    index = torch.stack([torch.randperm(n) for _ in range(torch.Size(dims).numel() // n)])
    return index.reshape(*[s for i, s in enumerate(dims) if i != d], n).movedim(-1, d).to(dtype)


I = torch.tensor  # noqa: E741

INDEX_CASES = {
    "one": (lambda x: x[I([2, 0, -1])], (5, 3)),
    "two_adjacent": (lambda x: x[:, I([0, 2]), I([1, 1])], (4, 3, 2)),
    "separated": (lambda x: x[I([0, 1]), :, I([1, 0])], (2, 3, 2)),
    "broadcast_2d": (lambda x: x[I([[0], [1]]), I([[0, 1, 2]])], (3, 4)),
    "trailing_none": (lambda x: torch.ops.aten.index.Tensor(x, [None, I([1, 0])]), (2, 3, 4)),
    "int32_index": (lambda x: x[I([1, 0], dtype=torch.int32)], (2, 3)),
    "scalar_index": (lambda x: x[I(1), I([0, 2])], (2, 3)),
}


@pytest.mark.parametrize("name", sorted(INDEX_CASES))
def test_index(name):
    fn, shape = INDEX_CASES[name]
    check_against_eager(fn, _x(*shape))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64, torch.bool])
def test_index_dtypes(dtype):
    cases = [INDEX_CASES[n] for n in ("two_adjacent", "separated", "broadcast_2d")]
    inputs = [_x(*shape, dtype=dtype) for _, shape in cases]
    check_against_eager(lambda *xs: tuple(fn(x) for (fn, _), x in zip(cases, xs)), *inputs)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_index_put(accumulate, dtype):
    x = _x(4, 3, dtype=dtype)
    rows = I([3, 0, 3, 1]) if accumulate else I([3, 0, 1])  # duplicates only when accumulating
    values = _x(len(rows), 3, dtype=dtype)
    put = lambda x, i, v: torch.ops.aten.index_put(x, i, v, accumulate)  # noqa: E731
    check_against_eager(lambda x, r, v: put(x, (r,), v), x, rows, values)
    check_against_eager(lambda x, c, v: put(x, (None, c), v), x, I([2, 0]), _x(1, 2, dtype=dtype))
    check_against_eager(lambda x, r, c: put(x, (r, c), I(5).to(x.dtype)), x, rows, rows % 3)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize(
    "mask_shape,value_shape", [((4, 3), ()), ((4,), (3,)), ((4,), (1, 3)), ((4, 3), (1,))]
)
def test_index_put_through_mask(mask_shape, value_shape, accumulate):
    """x[mask] = v keeps x's shape: lowered as a select when v is the same for every element."""
    x, v = _x(4, 3), _x(*value_shape)
    mask = torch.rand(mask_shape) > 0.5
    check_against_eager(lambda x, m, v: torch.index_put(x, (m,), v, accumulate), x, mask, v)


def test_index_put_of_no_values_through_a_mask_is_not_lowered():
    """A mask that selects nothing, given no values (size 0 where one value per element would
    go): not a one-value write our rule knows; it runs in eager torch, as eager does it."""
    x, mask = _x(3, 4), torch.zeros(3, 4, dtype=torch.bool)
    fn = lambda x, m, v: torch.index_put(x, (m,), v)  # noqa: E731
    values = torch.empty(0)
    check_against_eager(fn, x, mask, values, options={"fallback": "eager"})
    with pytest.raises(UnsupportedOpError, match="index_put"):
        compile_aten(fn, [x, mask, values])


def test_index_put_through_mask_of_leading_dims():
    x, mask, value = _x(2, 4, 3), torch.rand(4, 3) > 0.5, _x(2, 1)
    check_against_eager(lambda x, m, v: torch.ops.aten.index_put(x, [None, m], v), x, mask, value)


@pytest.mark.parametrize("d", [0, 1, -1])
def test_index_select_add_copy_fill(d):
    x = _x(4, 5)
    n = x.shape[d]
    index = I([n - 1, 0, 1])
    src = _x(*[3 if i == d % 2 else s for i, s in enumerate(x.shape)])
    check_against_eager(lambda x, i: torch.index_select(x, d, i), x, index)
    check_against_eager(lambda x, i, s: torch.index_add(x, d, i, s, alpha=2), x, I([1, 0, 1]), src)
    check_against_eager(lambda x, i, s: torch.index_copy(x, d, i, s), x, index, src)
    check_against_eager(lambda x, i: torch.index_fill(x, d, i, -3.0), x, index)


def test_index_ops_on_scalars():
    x, zero, zero_d = _x(), I([0]), I(0)
    check_against_eager(lambda x, i: torch.index_select(x, 0, i), x, zero)
    check_against_eager(lambda x, i: torch.gather(x, 0, i), x, zero_d)
    check_against_eager(lambda x, i, s: torch.scatter(x, 0, i, s), x, zero_d, I(5.0))
    check_against_eager(lambda x, i, s: torch.index_add(x, 0, i, s), x, zero, I(2.0))


def test_take():
    check_against_eager(lambda x, i: torch.take(x, i), _x(3, 4), I([[0, 11], [-1, 5]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("d", [0, 1, -1])
def test_gather(d, dtype):
    x = _x(4, 5, 3, dtype=dtype)
    index = torch.randint(0, x.shape[d], (3, 4, 2))  # smaller than x in every dim
    check_against_eager(lambda x, i: torch.gather(x, d, i), x, index)


@pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter")
@pytest.mark.parametrize("d", [0, 1, -1])
def test_scatter(d):
    x = _x(4, 5, 3)
    shape = list(x.shape)
    index = _perm_index(shape[d], shape, d % 3)
    src = _x(5, 6, 4)
    check_against_eager(lambda x, i, s: torch.scatter(x, d, i, s), x, index, src)
    check_against_eager(lambda x, i: torch.scatter(x, d, i, 2.5), x, index)
    part = index.narrow(d % 3 - 1, 0, 2)  # an index smaller than x in another dim
    check_against_eager(lambda x, i, s: torch.scatter(x, d, i, s), x, part, src)
    dup = torch.randint(0, shape[d], (3, 4, 2))  # duplicates add up
    check_against_eager(lambda x, i, s: torch.scatter_add(x, d, i, s), x, dup, src)
    check_against_eager(lambda x, i, s: torch.scatter(x, d, i, s, reduce="multiply"), x, dup, src)


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_scatter_reduce(reduce, include_self, dtype):
    x, src = _x(5, 3, dtype=dtype), _x(6, 3, dtype=dtype)
    index = torch.randint(0, 4, (6, 3))  # duplicates, and row 4 never written
    check_against_eager(
        lambda x, i, s: torch.scatter_reduce(x, 0, i, s, reduce, include_self=include_self),
        x,
        index,
        src,
    )


def _adding_scatters(rows: int, out: int, width: int) -> dict:
    """Every rule that adds rows at indices, `rows` rows into `out` (many duplicates each);
    index_put with accumulate is also what AOTAutograd makes of `weight[ids]`'s backward."""
    spread = lambda i: i[:, None].expand(rows, width)  # noqa: E731
    flat = lambda i: (i[:, None] * width + torch.arange(width)).reshape(-1)  # noqa: E731

    def zeros(g):
        return g.new_zeros(out, width)

    return {
        "index_put": lambda g, i: torch.index_put(zeros(g), (i,), g, accumulate=True),
        "index_add": lambda g, i: torch.index_add(zeros(g), 0, i, g),
        "scatter_add": lambda g, i: torch.scatter_add(zeros(g), 0, spread(i), g),
        "scatter_sum": lambda g, i: torch.scatter_reduce(zeros(g), 0, spread(i), g, "sum"),
        "scatter_mean": lambda g, i: torch.scatter_reduce(zeros(g), 0, spread(i), g, "mean"),
        "put": lambda g, i: zeros(g).put(flat(i), g.reshape(-1), accumulate=True),
    }


def test_adding_scatters_of_16_bit_floats_round_once():
    """bfloat16 rows added at 4 indices (128 duplicates each) are summed in float32 and
    rounded once, as eager's CUDA kernels do: within 1.25x of one rounding of the float64
    sum (adding in bfloat16 drifts ~9x further; eager CPU's index_put and put do)."""
    rows, out, width = 512, 4, 64
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(rows, width, generator=gen).bfloat16()
    index = torch.randint(0, out, (rows,), generator=gen)
    fns = _adding_scatters(rows, out, width)
    ours = compile_aten(lambda g, i: tuple(f(g, i) for f in fns.values()), (g, index))(g, index)
    for name, fn, got in zip(fns, fns.values(), ours):
        exact = fn(g.double(), index)
        rounded = (exact.bfloat16().double() - exact).norm()
        assert got.dtype == torch.bfloat16, name
        assert (got.double() - exact).norm() <= 1.25 * rounded, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_masked_fill(dtype):
    x, mask = _x(3, 4, dtype=dtype), torch.rand(4) > 0.5
    value = True if dtype == torch.bool else 2
    check_against_eager(lambda x, m: torch.masked_fill(x, m, value), x, mask)
    check_against_eager(lambda x, m, v: torch.masked_fill(x, m, v), x, mask, I(value, dtype=dtype))
    if dtype != torch.bool:  # a float value is cast to the input's dtype
        check_against_eager(lambda x, m: x.masked_fill(m, 3.7), x, mask)


def test_masked_fill_keeps_values_float32_cannot_hold():
    """The fill value reaches the result at the input's own dtype: int64 past 2**24 and 2**53
    (2**40 + 1 through float32 would come back 2**40), float64 fractions float32 rounds."""
    mask = I([True, False, True, True])
    cases = [
        (torch.arange(4) * 2**40, [2**40 + 1, 2**53 + 1, -(2**62) - 3, 2**24 + 1]),
        (torch.linspace(0, 1, 4, dtype=torch.float64), [0.1, 1 / 3, 1e300, 2**60 + 2**8]),
        (torch.arange(4, dtype=torch.int32) * 2**20, [2**24 + 1, 2**31 - 1]),
    ]
    for x, values in cases:
        fills = {f"{v}": lambda x, m, v=v: torch.masked_fill(x, m, v) for v in values}
        fills |= {
            f"tensor {v}": lambda x, m, v=v: x.masked_fill(m, I(v, dtype=x.dtype)) for v in values
        }
        got = compile_aten(_all_of(fills.values()), (x, mask))(x, mask)
        for (name, fill), result in zip(fills.items(), got):
            assert torch.equal(result, fill(x, mask)), (name, result, fill(x, mask))


def _all_of(fns):
    """One graph of every fn in `fns` (a tuple of their results)."""
    fns = tuple(fns)
    return lambda *args: tuple(f(*args) for f in fns)


def test_masked_fill_broadcasts_the_input():
    check_against_eager(lambda x, m: torch.masked_fill(x, m, -1.0), _x(4), torch.rand(3, 4) > 0.5)


@pytest.mark.parametrize("source_size", [12, 20])
def test_masked_scatter(source_size):
    x, mask, source = _x(3, 4), torch.rand(4) > 0.3, _x(source_size)
    check_against_eager(lambda x, m, s: torch.masked_scatter(x, m, s), x, mask, source)
    none = torch.zeros(3, 4, dtype=torch.bool)
    check_against_eager(lambda x, m, s: torch.masked_scatter(x, m, s), x, none, source)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("d", [0, -1])
def test_sort_stable(d, descending, dtype):
    """Ties (small integers) must keep their original order: the stable sort."""
    x = torch.randint(0, 3, (6, 7)).to(dtype)
    check_against_eager(
        lambda x: (
            *torch.sort(x, dim=d, descending=descending, stable=True),
            torch.argsort(x, dim=d, descending=descending, stable=True),
        ),
        x,
    )


@pytest.mark.parametrize("descending", [False, True])
def test_sort_nan_and_scalars(descending):
    x = I([3.0, float("nan"), -1.0, float("inf"), 0.5, float("-inf")])
    check_against_eager(lambda x: torch.sort(x, descending=descending), x)
    check_against_eager(lambda x: torch.sort(x, descending=descending), I(2.0))
    check_against_eager(lambda x: torch.topk(x, 3, largest=not descending), x)


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("d", [0, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_topk(d, largest, dtype):
    x = torch.randperm(4 * 6 * 5).reshape(4, 6, 5).to(dtype)  # distinct values: ties are unordered
    check_against_eager(lambda x: torch.topk(x, 3, dim=d, largest=largest), x)


def test_data_dependent_ops_have_no_rule():
    aten = torch.ops.aten
    for op in (aten.nonzero.default, aten.masked_select.default, aten._unique2.default):
        assert registry.lookup(op) is None, op


def _boolean_mask_graph(x, m):
    return (x[m] * 2).sum() + torch.nonzero(m).sum()


def test_mask_index_is_reported_unsupported():
    from torch.fx.experimental.proxy_tensor import make_fx

    x, m = _x(4, 5), torch.rand(4, 5) > 0.5
    gm = make_fx(_boolean_mask_graph, tracing_mode="fake")(x, m)
    index = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.index.Tensor)
    assert registry.lookup(index.target) is not None and not registry.supported(index)
    with pytest.raises(UnsupportedOpError, match=r"aten\.index\.Tensor"):
        compile_aten(_boolean_mask_graph, (x, m), {"fallback": "error"})


def test_data_dependent_ops_fall_back_through_torch_compile():
    """Dynamo keeps nonzero and x[mask] in the graph; they run in eager torch, the rest in ours."""
    import torch._dynamo

    x, m = _x(4, 5), torch.rand(4, 5) > 0.5

    def fn(x, m):
        selected = torch.sin(x[m]).sum() + torch.masked_select(x, m).sum()
        return selected + torch.nonzero(m).float().mean(0)

    # config.patch, not monkeypatch: undoing a monkeypatch deletes the config attribute.
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(fn, backend="tpu_inductor")(x, m), fn(x, m))
        torch._dynamo.reset()
        strict = torch.compile(fn, backend="tpu_inductor", options={"fallback": "error"})
        with pytest.raises(Exception, match=r"nonzero|masked_select|index\.Tensor") as info:
            strict(x, m)
        # Dynamo wraps what the backend raised in BackendCompilerFailed.
        assert isinstance(getattr(info.value, "inner_exception", info.value), UnsupportedOpError)
        torch._dynamo.reset()
