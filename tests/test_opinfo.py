"""PyTorch's OpInfo suite against our lowering: every entry passes or is expected to fail, for a reason.

`make test` runs float32 (3 samples per entry, as the table was made); `make opinfo` runs the
full set (float32, bfloat16, int64, bool) and writes the coverage report. A mismatch (a wrong
answer) always fails. An entry in the expected-failure table that now passes fails too, so the
table never hides progress: remove the entry.
"""

from __future__ import annotations

import pytest
import torch

from .opinfo import expected, runner

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
