"""The 64-bit policy, option `x64`: "keep" (default) computes int64 and float64 as torch does;
"narrow" computes them in 32 bits (int32/float32) and returns torch's dtypes.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import check_against_eager, compile_aten


def _int64_math(x):
    big = x.long() * 2**33  # past 2**31: needs 64-bit integers
    return big + 7, big // 3, (big >> 20) & 0xFFFF, big.sum(), torch.cumsum(big, 0)


def _float64_math(x):
    y = x.double() * 1e200  # past float32's range
    return y * y / 1e300, torch.exp(x.double() * 100), y / (x.double() + 10), y > 1e199


X = torch.tensor([1.0, -3.0, 2.5, 7.0, 1e5])


def test_keep_is_exact_for_int64():
    check_against_eager(_int64_math, X, rtol=0, atol=0)


def test_keep_is_exact_for_float64():
    check_against_eager(_float64_math, X, rtol=0, atol=0)
    # a sum may add in another order: float64 rounding, not float32's
    check_against_eager(lambda x: (x.double() * 1e200).sum(), X, rtol=1e-15, atol=0)


def test_int64_indices_and_argmax_keep_their_dtype():
    check_against_eager(lambda x: (x.argmax(), torch.arange(3) + 2**40, x.sort()[1]), X)


def test_narrow_compiles_in_32_bits():
    """Under x64="narrow" the same graph compiles and returns torch's dtypes (int64, float64),
    but computes in int32/float32: int64 values past 2**31 wrap and float64 values past
    float32's range overflow (inf, then nan). Values that fit in 32 bits are unchanged.
    """
    narrow = {"x64": "narrow"}
    ints = compile_aten(_int64_math, (X,), narrow)(X)
    floats = compile_aten(_float64_math, (X,), narrow)(X)
    assert [t.dtype for t in ints] == [t.dtype for t in _int64_math(X)]
    assert [t.dtype for t in floats] == [t.dtype for t in _float64_math(X)]
    assert not torch.equal(ints[0], _int64_math(X)[0]), "int64 past 2**31 cannot survive int32"
    assert not torch.isfinite(floats[0]).any(), "float64 past 3.4e38 overflows in float32"

    small = lambda x: (x.long() * 1000 + 1, x.double() / 3)  # noqa: E731  fits in 32 bits
    got = compile_aten(small, (X,), narrow)(X)
    want = small(X)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0, check_dtype=True)


@pytest.mark.parametrize("x64", ["keep", "narrow"])
def test_int64_inputs_cross_both_policies(x64):
    x = torch.arange(6).reshape(2, 3) - 2
    check_against_eager(lambda x: (x * 3, x.float().mean(1)), x, options={"x64": x64})
