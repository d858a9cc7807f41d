"""PyTorch's OpInfo suite against our lowering: every entry passes or is expected to fail, for a reason.

`make test` runs float32 (3 samples per entry, as the table was made), and for the entries whose
backward has a rule of its own, 2 requires_grad samples forward and backward; `make opinfo` runs
the full set (float32, bfloat16, int64, bool) and writes the coverage report. A mismatch (a wrong
answer) always fails. An entry in the expected-failure table that now passes fails too, so the
table never hides progress: remove the entry.
"""

from __future__ import annotations

import pytest
import torch

from tests.opinfo import backward, compare, expected, randomness, runner

_ENTRIES = [runner.entry_name(op) for op in runner.op_db()]
_OPS = dict(zip(_ENTRIES, runner.op_db()))


@pytest.mark.parametrize("entry", _ENTRIES)
def test_opinfo_float32(entry):
    outcome = runner.run_entry(_OPS[entry], torch.float32, samples=3)
    known = expected.EXPECTED.get(entry, {}).get("float32")
    assert outcome.status != "mismatch", f"{entry}: WRONG ANSWER: {outcome.detail}"
    if outcome.status in ("pass", "random", "no_samples"):
        assert known is None, (
            f"{entry} [float32] now passes: remove it from tests/opinfo/expected.py"
        )
        return
    assert known is not None, (
        f"{entry} [float32] newly fails: {outcome.status}: {outcome.detail}. Fix it, or add it to "
        "tests/opinfo/expected.py with the reason."
    )
    assert outcome.status == known[0], f"{entry}: expected {known}, got {outcome}"


def test_expected_table_names_real_entries_with_reasons():
    for entry, by_dtype in expected.EXPECTED.items():
        assert entry in _OPS, f"{entry} is not an OpInfo entry"
        for dtype_name, (status, reason) in by_dtype.items():
            assert dtype_name in runner.DTYPES and status != "mismatch" and reason.strip()


@pytest.mark.parametrize("entry", backward.BACKWARD)
def test_opinfo_backward_float32(entry):
    outcome = backward.run_backward(_OPS[entry], torch.float32, samples=2)
    assert outcome.status == "pass", f"{entry}: {outcome}"


def test_tolerance_overrides_are_the_cpu_accuracy_ones():
    """A CUDA Inductor override (atanh: atol 9e-3) or a gradient test's is not ours: taken from
    every device and test class, 21 float32 entries had an atol of 1e-3 or more."""
    assert compare.tolerance(_OPS["atanh"], torch.float32) == compare.TOLERANCES[torch.float32]
    loose = [e for e, op in _OPS.items() if compare.tolerance(op, torch.float32)["atol"] >= 1e-3]
    assert len(loose) <= 9, loose


@pytest.mark.parametrize(
    "entry",
    [
        "nn.functional.multi_head_attention_forward",
        "nn.functional.dropout",
        "nn.functional.feature_alpha_dropout.without_train",
    ],
)
def test_randomness_is_decided_per_sample(entry):
    """Samples in eval mode or with p=0 compute eager's numbers: they are compared on values."""
    import itertools

    cases = list(itertools.islice(_OPS[entry].sample_inputs("cpu", torch.float32), 3))
    assert not all(randomness.draws(entry, c) for c in cases)
    assert runner.run_entry(_OPS[entry], torch.float32, samples=3).status == "pass"


class _Case:
    def __init__(self, input, *args, **kwargs):
        self.input, self.args, self.kwargs = input, args, kwargs


def test_index_outputs_of_sort_like_ops_are_checked():
    """Ties may be ordered differently from eager's; indices must still select eager's values
    and, for a sort, be a permutation."""
    x = torch.tensor([[3.0, 1.0, 1.0, 2.0], [5.0, 5.0, 5.0, 0.0]])
    values, indices = torch.sort(x, dim=1)
    case, tol = _Case(x, 1), compare.TOLERANCES[torch.float32]
    swapped = indices.clone()
    swapped[0, :2] = swapped[0, :2].flip(0)  # the two 1.0s the other way round
    assert compare.compare_indexed("sort", case, (values, swapped), (values, indices), tol).ok
    repeated = indices.clone()
    repeated[1, 1] = repeated[1, 2]  # both 5.0s, but one position twice
    bad = compare.compare_indexed("sort", case, (values, repeated), (values, indices), tol)
    assert bad.status == "mismatch" and "repeat" in bad.detail
    wrong = indices.clone()
    wrong[0, 2] = 0  # 3.0 where 2.0 belongs
    bad = compare.compare_indexed("sort", case, (values, wrong), (values, indices), tol)
    assert bad.status == "mismatch" and "not eager's values" in bad.detail
    low, at = torch.min(x, 1)
    last = torch.tensor([2, 2])  # the last 1.0 of row 0: a valid minimum; row 1: index 2 is 5.0
    assert not compare.compare_indexed("median", _Case(x, 1), (low, last), (low, at), tol).ok
