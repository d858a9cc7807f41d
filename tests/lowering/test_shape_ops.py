"""Shape/view rules and matrix products against eager torch, as parametrized cases.

Matrix products live here too (no file of their own yet): mm, bmm, addmm, baddbmm, matmul,
in float32 (HIGHEST precision, so exact to float32 rounding) and bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_same, check_against_eager
from tpu_inductor.exc import LoweringError

STRICT = {"fallback": "error"}

# (rtol, atol) per dtype for the matrix products.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 2e-2)}

SHAPE_CASES = {
    "view": (lambda x: x.view(4, -1), (2, 3, 4)),
    "reshape_0d": (lambda x: x.reshape(1, 1), ()),
    "reshape_empty": (lambda x: (x.reshape(-1), x.reshape(3, 0)), (0, 3)),
    "permute": (lambda x: x.permute(2, 0, 1), (2, 3, 4)),
    "transpose_neg": (lambda x: x.transpose(-1, 0), (2, 3, 4)),
    "t": (lambda x: x.t(), (3, 4)),
    "t_1d": (lambda x: x.t(), (3,)),
    "expand": (lambda x: x.expand(2, -1, 3), (4, 1)),
    "expand_0d": (lambda x: x.expand(3, 2), ()),
    "squeeze": (lambda x: x.squeeze(), (1, 3, 1)),
    "squeeze_dims": (lambda x: x.squeeze((0, 1)), (1, 3, 1)),
    "squeeze_0d": (lambda x: x.squeeze(0), ()),
    "unsqueeze_neg": (lambda x: x.unsqueeze(-1), (2, 3)),
    "unsqueeze_0d": (lambda x: x.unsqueeze(0), ()),
    "cat": (lambda x: torch.cat([x, x * 2, x[:, :1]], 1), (2, 3)),
    "cat_empty": (lambda x: torch.cat([x, torch.zeros(0)], 0), (3,)),
    "stack": (lambda x: torch.stack([x, x + 1], -1), (2, 3)),
    "split": (lambda x: x.split(2, 1), (2, 5)),
    "split_sizes": (lambda x: x.split([1, 3, 1], -1), (2, 5)),
    "unbind": (lambda x: x.unbind(1), (2, 3)),
    "slice_step": (lambda x: x[:, 1::2], (2, 7)),
    "slice_neg": (lambda x: x[-3:-1], (5, 2)),
    "slice_past_end": (lambda x: x[2:100], (5,)),
    "slice_before_start": (lambda x: x[-100:2], (5, 3)),
    "select_neg": (lambda x: x[:, -1], (2, 3)),
    "narrow": (lambda x: x.narrow(1, 1, 2), (2, 4)),
    "diagonal": (lambda x: torch.diagonal(x, 1, 0, 1), (3, 4)),
    "flip": (lambda x: x.flip(0, -1), (2, 3)),
    "roll": (lambda x: x.roll(2, 1), (2, 5)),
    "roll_flat": (lambda x: x.roll(3), (2, 5)),
    "repeat": (lambda x: x.repeat(2, 1, 3), (2, 3)),
    "pad": (lambda x: torch.nn.functional.pad(x, (1, 2, 0, 1), value=-1.0), (2, 3)),
    "pad_negative": (lambda x: torch.nn.functional.pad(x, (-1, 1)), (2, 3)),
    "tril": (lambda x: x.tril(-1), (3, 4)),
    "triu": (lambda x: x.triu(1), (3, 4)),
    "to_dtype": (lambda x: x.to(torch.int64), (2, 3)),
    "to_bf16": (lambda x: x.to(torch.bfloat16), (2, 3)),
    "slice_scatter": (lambda x: torch.slice_scatter(x, x[:, ::2] * 0 + 7, 1, 0, None, 2), (2, 5)),
    "select_scatter": (lambda x: torch.select_scatter(x, x[0] + 1, 0, -1), (3, 2)),
    # of a result: an input read at an explicit offset runs in eager torch (the test below)
    "as_strided": (lambda x: (x + 0).as_strided((3, 2), (1, 3), 1), (3, 4)),
    "as_strided_empty": (lambda x: (x + 0).as_strided((0,), (1,), 50), (3, 4)),
    "view_dtype": (lambda x: x.view(torch.int32), (2, 3)),
}


@pytest.mark.parametrize("name", sorted(SHAPE_CASES))
def test_shape_op(name):
    fn, shape = SHAPE_CASES[name]
    check_against_eager(fn, torch.randn(shape))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64, torch.bool])
def test_shape_ops_keep_dtype(dtype):
    x = (torch.randn(2, 3, 4) * 5).to(dtype)
    check_against_eager(lambda x: (x.permute(1, 0, 2)[:, 1:].reshape(-1), torch.cat([x, x])), x)


# Operands: a (2, 3, 4), b (2, 4, 5), c (5,).
PRODUCTS = {
    "mm": lambda a, b, c: a[0] @ b[0],
    "bmm": lambda a, b, c: torch.bmm(a, b),
    "matmul_broadcast": lambda a, b, c: a @ b[0],
    "mv": lambda a, b, c: torch.mv(a[0], b[0, :, 0]),
    "addmm": lambda a, b, c: torch.addmm(c, a[0], b[0]),
    "addmm_scaled": lambda a, b, c: torch.addmm(c, a[1], b[1], beta=0.5, alpha=2),
    "addmm_beta0": lambda a, b, c: torch.addmm(c, a[1], b[1], beta=0),
    "baddbmm": lambda a, b, c: torch.baddbmm(c, a, b, alpha=0.5),
    "linear": lambda a, b, c: torch.nn.functional.linear(a, b[0].t(), c),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(PRODUCTS))
def test_matrix_product(name, dtype):
    a, b, c = (torch.randn(s).to(dtype) for s in ((2, 3, 4), (2, 4, 5), (5,)))
    rtol, atol = TOLERANCES[dtype]
    check_against_eager(PRODUCTS[name], a, b, c, rtol=rtol, atol=atol)


def test_as_strided_scatter():
    src = torch.randn(3, 2)
    scatter = lambda x, s: torch.as_strided_scatter(x * 1, s, (3, 2), (1, 3), 1)  # noqa: E731
    check_against_eager(scatter, torch.randn(3, 4), src, options=STRICT)
    check_against_eager(lambda x, s: scatter(x, s)[..., None], torch.randn(3, 4), src)
    # Strides index torch's storage, not our row-major value: a transposed result's storage
    # is its values in the other order.
    check_against_eager(scatter, torch.randn(4, 3).t(), src, options=STRICT)


@pytest.mark.parametrize(
    "make, view",
    [
        (lambda: torch.randn(4, 3).t(), ((3, 4), (1, 3))),  # Longformer's _chunk
        (lambda: torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last), ((6, 8), (8, 1))),
        (lambda: torch.randn(3, 1, 4).transpose(0, 2), ((2, 6), (6, 1))),
    ],
)
def test_as_strided_reads_the_storage_of_tensors_of_any_dense_layout(make, view):
    """Of an input (at its own offset) and of a result (at an explicit one: a result's storage
    is the graph's, so its offsets are known when it is compiled)."""
    x = make()
    for fn in (
        lambda x: x.as_strided(*view) * 2,
        lambda x: (x * 2).as_strided(*view, 0) + 1,
    ):
        compiled = torch.compile(fn, backend="tpu_inductor", options=STRICT, dynamic=False)
        assert_same(compiled(x), fn(x))


def test_as_strided_outside_what_it_can_read_runs_in_eager():
    """A slice's storage before or after it, a strided (non-dense) argument, an input read at
    an absolute offset: the values are not in the argument we hold, or depend on where the
    input lies in its storage, so the op runs in eager torch, with what it reads computed there
    (a compiled region would return a contiguous copy)."""
    base = torch.arange(24.0).reshape(2, 12)
    calls = [
        (lambda x: x.as_strided((3, 4), (4, 1)) + 1, torch.randn(5, 4)[1:]),
        (lambda x: x.as_strided((2, 2), (1, 1), 0) + 1, torch.randn(5, 4)[1:]),
        (lambda x: x.as_strided((2, 2), (1, 2), 0) + 1, torch.randn(4, 6)[:, ::2]),
        (lambda x: (x * 2)[1:].as_strided((2,), (1,), 3) + 1, torch.arange(8.0).reshape(2, 4)),
        (
            lambda x: (x * 2)[0:1].expand(3, 4).as_strided((2, 4), (4, 1)),
            torch.arange(8.0).view(2, 4),
        ),
        (lambda x: torch.as_strided_scatter(x, -x[:2], (2,), (1,), 1), base[0]),
    ]
    for fn, x in calls:
        compiled = torch.compile(fn, backend="tpu_inductor", dynamic=False)
        assert_same(compiled(x), fn(x))
        with pytest.raises(Exception, match="as_strided"):
            torch.compile(fn, backend="tpu_inductor", options=STRICT, dynamic=False)(x)
    # Symbolic sizes: as_strided of a transposed result runs in eager, on that result's eager
    # layout (a compiled region would hand it a contiguous copy).
    flat = lambda x: (x * 2).t().as_strided((x.numel(),), (1,)) + 1  # noqa: E731
    compiled = torch.compile(flat, backend="tpu_inductor")
    for shape in ((2, 4), (3, 5), (4, 6)):
        x = torch.arange(float(shape[0] * shape[1])).reshape(shape)
        assert_same(compiled(x), flat(x))
    # The same graph, called with an input at another offset of the same storage.
    read = lambda x: x.as_strided((2, 2), (4, 1), 0) * 1  # noqa: E731
    compiled = torch.compile(read, backend="tpu_inductor")
    for x in (base[0], base[1]):
        assert_same(compiled(x), read(x))


def test_as_strided_of_an_input_at_an_explicit_offset_returned_is_the_input_viewed():
    """Returned as it is, a view of an input at an absolute offset is made at run time from the
    input the graph is called with (its own storage, eager's strides and offset): one compiled
    graph is right for inputs lying anywhere in larger storages, the result aliases the input
    (a write through it shows in the input), and a gradient flows back. Reading past the input
    the graph was compiled for, or using the view in the graph, still runs in eager torch."""
    base = torch.arange(40.0)
    calls = [
        (lambda x: torch.as_strided(x, (2, 2), (1, 2), 1), (3, 3)),
        (lambda x: torch.as_strided(x, (2, 2), (1, 2), 0), (3, 3)),
        (lambda x: (torch.as_strided(x, (3,), (2,), 2), x.as_strided((0,), (1,), 5)), (2, 4)),
    ]
    for fn, shape in calls:
        compiled = torch.compile(fn, backend="tpu_inductor", options=STRICT, dynamic=False)
        size = shape[0] * shape[1]
        for x in (torch.randn(shape), base[:size].view(shape), base[7 : 7 + size].view(shape)):
            got, want = compiled(x), fn(x)
            assert_same(got, want)
            for g, w in zip(_as_list(got), _as_list(want)):
                assert (g.stride(), g.storage_offset()) == (w.stride(), w.storage_offset())
                assert g.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    compiled = torch.compile(calls[0][0], backend="tpu_inductor", options=STRICT)
    written, want = base.clone(), base.clone()
    compiled(written[3:12].view(3, 3)).mul_(-1)
    calls[0][0](want[3:12].view(3, 3)).mul_(-1)
    assert_same(written, want)
    assert written[1:5].lt(0).all()  # storage the input does not cover: the offset is absolute
    # Training: the view's gradient is the input's, as in eager.
    x = torch.randn(3, 3, requires_grad=True)
    weight = torch.randn(2, 2)
    compiled = torch.compile(calls[0][0], backend="tpu_inductor", options=STRICT)
    (grad,) = torch.autograd.grad((compiled(x) * weight).sum(), x)
    (want,) = torch.autograd.grad((calls[0][0](x) * weight).sum(), x)
    assert_same(grad, want)
    for fn in (
        lambda x: torch.as_strided(x, (2, 2), (1, 2), 20),  # past the compiled input's values
        lambda x: (lambda v: (v, v * 2))(torch.as_strided(x, (2, 2), (1, 2), 1)),  # read here
    ):
        x = base[:20].view(4, 5)
        assert_same(torch.compile(fn, backend="tpu_inductor", dynamic=False)(x), fn(x))
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="as_strided"):
            torch.compile(fn, backend="tpu_inductor", options=STRICT, dynamic=False)(x)


def _as_list(value) -> list:
    return list(value) if isinstance(value, tuple) else [value]


def test_as_strided_past_its_arguments_storage_is_an_error_with_symbolic_sizes():
    """jax would clamp the reads past the end; eager torch raises (or reads a larger base)."""
    fn = lambda x: (x * 1).as_strided((x.shape[0] + 2,), (1,))  # noqa: E731
    compiled = torch.compile(fn, backend="tpu_inductor", dynamic=True)
    with pytest.raises(Exception, match=r"reads position 9 of a storage of 8 elements"):
        compiled(torch.arange(8.0))


def test_mutating_one_of_two_aliased_inputs():
    """AOTAutograd writes a view input's mutation back into its aliased base input with
    as_strided_scatter."""

    def fn(x, y):
        y.add_(10)
        return x * 1

    expected_base, base = torch.randn(4, 5), torch.zeros(4, 5)
    base.copy_(expected_base)
    expected = fn(expected_base, expected_base[1])
    compiled = torch.compile(fn, backend="tpu_inductor")  # the write-back runs in eager
    assert_same(compiled(base, base[1]), expected)
    assert_same(base, expected_base)


def _randn(*shape, dtype=torch.float32):
    """Drawn at collection, so from a generator of their own (not whatever ran before)."""
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(0))


_BYTE_VIEWS = [  # (input, dtype viewed as): sizes change the last dim, as in torch
    (_randn(3, 4), torch.int16),
    (_randn(3, 4), torch.float64),
    (_randn(3, 4), torch.complex64),
    (_randn(2, 3, 4), torch.complex64),
    (_randn(2, 4, dtype=torch.complex64), torch.float32),
    (_randn(2, 4, dtype=torch.complex64), torch.uint8),
    (torch.randint(-9, 9, (2, 8), generator=torch.Generator().manual_seed(1)), torch.int8),
    (_randn(4, 6).half(), torch.float32),
    (_randn(5, 4) > 0, torch.uint8),
    (torch.tensor([[0, 1, 1, 0]], dtype=torch.uint8), torch.bool),
]


@pytest.mark.parametrize(("x", "dtype"), _BYTE_VIEWS, ids=lambda v: str(getattr(v, "dtype", v)))
def test_view_as_a_dtype_of_another_size(x, dtype):
    """bool and complex included: the same bytes, read as another dtype."""

    def f(t):
        return (t + 0 if t.dtype != torch.bool else ~~t).view(dtype)  # computed, then viewed

    check_against_eager(f, x, options={"fallback": "error"})


def test_view_as_a_dtype_of_64_bit_values_under_narrow_is_refused():
    with pytest.raises(LoweringError, match="64-bit values under x64='narrow'"):
        check_against_eager(
            lambda t: (t + 0).view(torch.int32),
            torch.ones(2, 2, dtype=torch.int64),
            options={"fallback": "error", "x64": "narrow"},
        )
