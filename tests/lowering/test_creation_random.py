"""Creation rules against eager torch, and random rules by their statistics.

Random numbers come from jax.random keyed from torch's generator, so they are not bitwise
eager's: the checks are moments (mean/var within a tolerance for n samples), that successive
calls differ, and that torch.manual_seed makes a run repeat. The unrolled threefry behind them
is checked bit for bit against jax's own.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx
from tpu_inductor.lowering.prng import threefry_unrolled
from tpu_inductor.lowering.stablehlo import lower

from tests.helpers import check_against_eager, compile_aten, functional

CREATION_CASES = {
    "zeros": lambda x: torch.zeros(2, 3) + x,
    "ones_int": lambda x: torch.ones(2, 3, dtype=torch.int64),
    "full": lambda x: torch.full((2, 3), 2.5) * x,
    "full_bool": lambda x: torch.full((3,), True),
    "full_like": lambda x: torch.full_like(x, 7),
    "zeros_like_int": lambda x: torch.zeros_like(x, dtype=torch.int64),
    "ones_like_0d": lambda x: torch.ones_like(x[0, 0]),
    "new_zeros": lambda x: x.new_zeros(4),
    "new_ones": lambda x: x.new_ones((2, 2), dtype=torch.bfloat16),
    "new_full": lambda x: x.new_full((3,), -1.5),
    "empty_shape": lambda x: torch.empty(2, 0).shape[0] + x,
    "arange": lambda x: torch.arange(5),
    "arange_start_step": lambda x: torch.arange(2, 11, 3),
    "arange_float": lambda x: torch.arange(0.5, 2.0, 0.25),
    "arange_neg_step": lambda x: torch.arange(5, -3, -2),
    "scalar_tensor": lambda x: torch.scalar_tensor(3.5) + x,
    "fill": lambda x: torch.fill(x, 4.0),
    "zero": lambda x: torch.ops.aten.zero(x),
}


@pytest.mark.parametrize("name", sorted(CREATION_CASES))
def test_creation(name):
    check_against_eager(CREATION_CASES[name], torch.randn(2, 3))


N = 40_000
# (op, mean, variance) of each sampler, on N draws; moments must be within ~6 standard errors.
SAMPLERS = {
    "rand": (lambda x: torch.rand(N), 0.5, 1 / 12),
    "rand_like_bf16": (lambda x: torch.rand_like(x, dtype=torch.bfloat16), 0.5, 1 / 12),
    "randn": (lambda x: torch.randn(N), 0.0, 1.0),
    "randn_like": (lambda x: torch.randn_like(x), 0.0, 1.0),
    "bernoulli_p": (lambda x: torch.bernoulli(torch.full_like(x, 0.3)), 0.3, 0.21),
    "bernoulli_scalar_p": (lambda x: torch.bernoulli(x, 0.8), 0.8, 0.16),
    "randint": (lambda x: torch.randint(3, 9, (N,)).float(), 5.5, (6**2 - 1) / 12),
    "dropout": (lambda x: torch.ops.aten.native_dropout(x + 1, 0.25, True)[0], 1.0, 1 / 3),
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_random_statistics(name):
    fn, mean, var = SAMPLERS[name]
    x = torch.zeros(N)
    compiled = compile_aten(fn, (x,))
    first, second, eager = compiled(x), compiled(x), fn(x)
    assert (first.shape, first.dtype) == (eager.shape, eager.dtype)
    first = first.float()
    assert abs(first.mean().item() - mean) < 6 * (var / N) ** 0.5, (first.mean(), mean)
    assert abs(first.var().item() - var) < 12 * var * (2 / N) ** 0.5, (first.var(), var)
    assert not torch.equal(first, second.float()), "successive calls drew the same numbers"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_uniform_never_reaches_its_upper_bound(dtype):
    """[low, high) in the result dtype: a draw just below 1 must not round up to 1."""
    x = torch.zeros(200_000, dtype=dtype)
    fn = lambda x: (torch.rand_like(x), x.uniform_(-1.0, 1.0))  # noqa: E731
    unit, signed = compile_aten(functional(fn), (x.clone(),))(x)
    assert 0 <= unit.min() and unit.max() < 1 and -1 <= signed.min() and signed.max() < 1
    if dtype.itemsize == 2:  # 200k draws reach the top of a 16-bit grid, as eager's do
        assert unit.max() >= 1 - torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uniform_never_goes_below_its_lower_bound(dtype):
    """bfloat16's 0.1 is 0.10009765625: a draw rounded down into the dtype must not fall under
    `low` (0.2% of bfloat16 draws did)."""
    fn = lambda x: x.uniform_(0.1, 0.2)  # noqa: E731
    compiled = torch.compile(fn, backend="tpu_inductor", options={"fallback": "error"})
    drawn = compiled(torch.zeros(200_000, dtype=dtype))
    assert drawn.double().min() >= 0.1 and drawn.double().max() < 0.2


def test_rand_of_a_complex_dtype_draws_both_parts_in_the_unit_interval():
    x = torch.zeros(20_000, dtype=torch.complex64)
    drawn = compile_aten(lambda x: (torch.rand_like(x), torch.rand(3, dtype=x.dtype)), (x,))(x)
    assert [d.dtype for d in drawn] == [torch.complex64] * 2
    for part in (drawn[0].real, drawn[0].imag):
        assert 0 <= part.min() and part.max() < 1 and abs(part.mean() - 0.5) < 0.02
    assert abs(torch.corrcoef(torch.stack([drawn[0].real, drawn[0].imag]))[0, 1]) < 0.05


def test_dropout_keeps_what_it_scales():
    x = torch.randn(1000)
    out, mask = compile_aten(lambda x: torch.ops.aten.native_dropout(x, 0.4, True), (x,))(x)
    assert mask.dtype == torch.bool and 0.5 < mask.float().mean() < 0.7
    torch.testing.assert_close(out, torch.where(mask, x / 0.6, torch.zeros(())))
    check_against_eager(lambda x: torch.ops.aten.native_dropout(x, 0.4, False), x)


def test_manual_seed_repeats():
    x = torch.zeros(64)
    compiled = compile_aten(lambda x: (torch.rand_like(x), torch.randn(8)), (x,))
    torch.manual_seed(123)
    first = compiled(x)
    torch.manual_seed(123)
    again = compiled(x)
    torch.manual_seed(124)
    other = compiled(x)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first[0], other[0])
    assert not torch.equal(first[0][:8], first[1]), "two random nodes drew the same stream"


@settings(max_examples=25, deadline=None)
@given(
    key=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
    bits=st.sampled_from([8, 16, 32]),
)
def test_unrolled_threefry_gives_jax_threefry_bits(key, shape, bits):
    data = jax.numpy.asarray(np.array(key, np.uint32))
    ours = jax.random.wrap_key_data(data, impl=threefry_unrolled())
    theirs = jax.random.wrap_key_data(data)
    dtype = {8: np.uint8, 16: np.uint16, 32: np.uint32}[bits]
    for fold in (0, 5, 2**32 - 1):
        np.testing.assert_array_equal(
            np.asarray(jax.random.key_data(jax.random.fold_in(ours, fold))),
            np.asarray(jax.random.key_data(jax.random.fold_in(theirs, fold))),
        )
        expected = jax.random.bits(jax.random.fold_in(theirs, fold), shape, dtype)
        actual = jax.random.bits(jax.random.fold_in(ours, fold), shape, dtype)
        np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))
    np.testing.assert_array_equal(
        np.asarray(jax.random.normal(ours, shape)), np.asarray(jax.random.normal(theirs, shape))
    )


def test_unrolled_threefry_64_bit_words():
    data = jax.numpy.asarray(np.array([3, 11], np.uint32))
    with jax.enable_x64(True):
        theirs = jax.random.bits(jax.random.wrap_key_data(data), (33,), np.uint64)
        ours = jax.random.bits(
            jax.random.wrap_key_data(data, impl=threefry_unrolled()), (33,), np.uint64
        )
    assert ours.dtype == np.uint64
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_dropout_lowers_without_a_loop():
    """jax's CPU threefry is a five-iteration loop over the whole state; ours is one fusion."""
    gm = make_fx(lambda x: torch.ops.aten.native_dropout(x, 0.1, True), tracing_mode="fake")(
        torch.zeros(64, 64)
    )
    lowered = lower(gm, [torch.zeros(64, 64)])
    assert "stablehlo.while" not in lowered.text
