"""Input mutations and views end to end: writes to inputs come back, outputs that share a
storage are views of it, inputs of other layouts, offsets, signs and regions are read right.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_same, compile_tpu
from tpu_inductor.cache import stores

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_input_mutation_is_written_back():
    def f(buf, x):
        buf.add_(x)
        return buf * 2

    buf, x = torch.zeros(3), torch.arange(3.0)
    out = compile_tpu(f)(buf, x)
    assert_same(buf, torch.arange(3.0))
    assert_same(out, torch.arange(3.0) * 2)


def _output_and_its_views(x):
    y = x * 2
    return y, y[0], y.t(), y.view(-1)[2:5]


def _views_of_an_intermediate(x):  # the base is no output: computed as a hidden module result
    y = x * 2
    return y.t(), y[:2], y[1:], y.view(torch.int32)[0]


@pytest.mark.parametrize("outputs", [_output_and_its_views, _views_of_an_intermediate])
@pytest.mark.parametrize("from_disk", [False, True], ids=["compiled", "disk_cache_hit"])
def test_outputs_that_share_a_storage_are_views_of_it(from_disk, outputs):
    """As in eager: a write through `y` shows through `y[0]` (computed once, viewed)."""
    x = torch.randn(3, 4)
    if from_disk:
        with torch.no_grad():
            compile_tpu(outputs)(x)
        torch._dynamo.reset()
        stores.memory_cache.clear()  # the call description then comes back from its JSON
    hits = stores.counters["disk_hit"]
    with torch.no_grad():
        got_all = compile_tpu(outputs)(x)
    assert stores.counters["disk_hit"] == hits + from_disk
    want_all = outputs(x)
    for got, want in zip(got_all, want_all):
        assert_same(got, want)
        assert (got.stride(), got.storage_offset()) == (want.stride(), want.storage_offset())
    got_all[0].fill_(7.0)
    want_all[0].fill_(7.0)
    for got, want in zip(got_all, want_all):
        assert_same(got, want)


def test_transposed_and_sliced_inputs_are_copied_not_misread():
    f = compile_tpu(lambda a, b: a @ b + 1)
    base = torch.randn(6, 5)
    a, b = base.t()[:, 1:4], torch.randn(5, 4)[1:4]
    assert_same(f(a, b), a @ b + 1)


def test_views_of_results_computed_in_eager_stay_views_in_a_split_graph():
    """torch.cond runs in eager (a split graph): the view of its result must not be compiled
    into a region, which would return a copy."""

    def f(x, y):
        z = torch.cond(y.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (x,))
        return z, z.view(-1)[:3], z.t() * 2

    x, y = torch.randn(4, 5), torch.ones(4, 5)
    with torch.no_grad():
        z, v, w = compile_tpu(f)(x, y)
    assert_same(w, x.sin().t() * 2)
    v.zero_()
    assert_same(z.view(-1)[:3], torch.zeros(3))
    assert v._base is z


def test_an_input_of_another_layout_is_not_given_an_executable_lowered_for_the_first():
    """Rules may lower by input layout (det factors a contiguous A^T): strides are in the key."""

    def det_grad(a):
        return torch.autograd.grad(torch.linalg.det(a), a)[0]

    compiled = torch.compile(det_grad, backend="tpu_inductor", dynamic=False)
    a = torch.randn(4, 4) + 4 * torch.eye(4)
    for matrix in (a, a.t().contiguous().t()):  # the same values, transposed storage
        leaf = matrix.detach().requires_grad_()
        assert_same(
            compiled(leaf), det_grad(matrix.detach().requires_grad_()), rtol=1e-4, atol=1e-4
        )


def _same_views(got_all, want_all, base_got, base_want):
    for got, want in zip(got_all, want_all):
        assert_same(got, want)
        assert (got.stride(), got.storage_offset()) == (want.stride(), want.storage_offset())
        shares = got.untyped_storage().data_ptr() == base_got.untyped_storage().data_ptr()
        assert shares == (
            want.untyped_storage().data_ptr() == base_want.untyped_storage().data_ptr()
        )


def test_views_of_an_input_at_a_symbolic_offset_are_views_at_that_offset():
    """Dynamo makes `i` symbolic on the second call; AOTAutograd rebuilds a view of an input
    from the offset of ours: a copy put x[i] at row 0 for every i."""

    def f(x, i):
        return x[i], x[i:], x.narrow(1, i, 2)

    compiled, x = compile_tpu(f), torch.arange(20.0).reshape(4, 5)
    for i in range(3):
        _same_views(compiled(x, i), f(x, i), x, x)


def test_views_of_a_region_input_in_a_split_graph_are_views_of_it():
    """y is computed in one region and viewed in the next (torch.cond splits the graph)."""

    def f(x):
        y = x + 1
        z = torch.cond(y.sum() > 0, lambda t: t * 2, lambda t: t * 3, (y,))
        return y, y[1:], y.t(), z.sum()

    x = torch.randn(6, 8)
    with torch.no_grad():
        got, want = compile_tpu(f)(x), f(x)
    _same_views(got, want, got[0], want[0])
    got[0][1, 0] = 100.0
    assert got[1][0, 0] == 100.0 and got[2][0, 1] == 100.0


def test_conjugate_and_negative_view_inputs_are_read_with_their_sign():
    # x.conj() and torch._neg_view share the storage and set a lazy bit that dlpack drops.
    f = compile_tpu(lambda x: x + 1)
    c = torch.tensor([1 + 2j, 3 - 4j]).conj()
    n = torch._neg_view(torch.tensor([1.0, 2.0]))
    assert_same(f(c), c + 1)
    assert_same(f(n), n + 1)
    g = compile_tpu(lambda x: x.mul_(2))
    c_eager = torch.tensor([1 + 2j, 3 - 4j]).conj()
    g(c)
    assert_same(c, c_eager.mul_(2))
