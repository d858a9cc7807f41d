"""Recompile explanations (debug/recompiles.py): what changed, from what to what, against which
earlier compile, and what would avoid it.
"""

from __future__ import annotations

import logging

import torch

from tests.debug.dump_run import folders
from tests.helpers import assert_same
from tpu_inductor.debug import recompiles, records, report


def test_shape_change_recompile_is_explained(run_dump):
    _, compiles, messages = run_dump
    forward = folders(compiles, "forward")
    assert [c["recompile_reason"] is not None for c in forward] == [False, True, True]
    # Size 5: Dynamo's new trace, with symbolic sizes, compared with its static trace at 2.
    retrace = forward[1]["recompile_reason"]
    assert retrace.startswith("Dynamo traced it again, with symbolic sizes: size 2 → 5 ")
    assert "size 2 → 5 at dim 0 of input 3" in retrace
    assert "torch._dynamo.mark_dynamic(input, 0) before the first call" in retrace
    # Size 7: the symbolic graph compiled for one more size.
    reason = forward[-1]["recompile_reason"]
    # one symbol's change, told once: the dim and the size input that carry it
    assert reason.startswith("size 5 → 7 at the value of input 2 and dim 0 of input 3.")
    assert reason.count("To avoid it") == 1 and reason.count("pad ") == 1
    assert "pad dim 0 of input 3 to a few fixed sizes, one compile each" in reason
    assert "bucket" not in retrace + reason  # not a knob torch.compile users have (yet)
    graphs = [c["graph"] for c in forward]
    lines = [m for m in messages if m.startswith("tpu_inductor: recompiling for new input")]
    assert f"({graphs[1]}, Dynamo's new trace of {graphs[0]}): {retrace}" in lines[0]
    assert f"tpu_inductor: recompiling for new input sizes ({graphs[2]}): {reason}" in lines


def test_recompiles_for_a_python_number_are_explained_as_such():
    def f(x, n):  # 12 // n (n could be 0, where Python raises) is not traced: compiled per value
        return x * (12 // n)

    compiled = torch.compile(f, backend="tpu_inductor", options={"cache": False})
    before = len(records.records)
    for n in (2, 3, 4):
        compiled(torch.ones(2), n)
    retrace, again = (r.recompile for r in records.records[before + 1 :])
    assert retrace.startswith("Dynamo traced it again: a Python number changed between calls")
    assert again.startswith("size 3 → 4 at the value of input 0.")
    assert "pass a number that varies and sets no size as a 0-d tensor" in again


def test_explain_recompile_texts():
    old = (((8, 16), "torch.float32"), 3)
    new = (((12, 16), "torch.float32"), 3)
    assert recompiles.explain_recompile(old, new, same_graph=False) == (
        "size 8 → 12 at dim 0 of input 0. To avoid it: pad dim 0 of input 0 to a few fixed "
        "sizes, one compile each (torch._dynamo.mark_dynamic(input, 0) "
        "before the first call spares Dynamo's new traces, not the compile per size)."
    )
    assert recompiles.explain_recompile(old, new, same_graph=True).endswith(
        "(a graph with symbolic sizes compiles once per size here)."
    )
    dtype = recompiles.explain_recompile(old, (((8, 16), "torch.bfloat16"), 3), same_graph=True)
    assert dtype.startswith("input 0 (float32[8, 16] → bfloat16[8, 16]): dtype torch.float32")
    assert "cast input 0 to float32" in dtype
    scalar = recompiles.explain_recompile(old, (old[0], 4), same_graph=False)
    assert scalar.startswith("input 1: 3 → 4.") and "as a 0-d tensor" in scalar
    option = recompiles.explain_recompile(
        old, old, same_graph=True, old_options={"x64": "keep"}, new_options={"x64": "narrow"}
    )
    assert option.startswith("option x64: 'keep' → 'narrow'.")


def test_a_recompile_is_told_once_per_symbol():
    """A decode step's ten inputs of one cache length and a mask one longer: two sizes, one
    piece of advice (it was a sentence per input)."""
    cache = [((2, 4, 8, 8), "torch.float32"), 8] * 5
    longer = [((2, 4, 16, 8), "torch.float32"), 16] * 5
    old, new = (*cache, ((2, 9), "torch.int64")), (*longer, ((2, 17), "torch.int64"))
    text = recompiles.explain_recompile(old, new, same_graph=True)
    assert text == (
        "size 8 → 16 at dim 2 of inputs 0, 2, 4, 6, 8 and the value of inputs 1, 3, 5, 7, 9; "
        "size 9 → 17 at dim 1 of input 10. To avoid it: pad dim 2 of input 0 (and every dim "
        "of size 8) and dim 1 of input 10 to a few fixed sizes, one compile each (a graph with "
        "symbolic sizes compiles once per size here)."
    )
    assert "\n" not in text


def test_recompile_is_explained_against_the_closest_earlier_compile(caplog):
    def fn(x):
        return x.sin() + 1

    torch._dynamo.reset()
    x = torch.randn(4)
    with caplog.at_level(logging.INFO, logger="tpu_inductor.debug.recompiles"):
        keep = torch.compile(fn, backend="tpu_inductor", options={"cache": False})
        keep(x)
        keep(x.double())  # the latest compile: float64 input
        narrow = {"cache": False, "x64": "narrow"}
        torch.compile(fn, backend="tpu_inductor", options=narrow)(x)  # as the first, but x64
    first, latest, last = records.records[-3:]
    assert latest.recompile.startswith("input 0 (float32[4] → float64[4])")
    assert last.recompile == (
        "option x64: 'keep' → 'narrow'. To avoid it: use the same options for every "
        "torch.compile of this model."
    )
    assert f"({last.graph}, the same graph as {first.graph}): option x64" in caplog.text


def test_identical_graph_from_a_static_recompile_says_mark_dynamic(tmp_path, caplog):
    torch._dynamo.reset()
    fn = torch.compile(
        lambda x: x * 2 + 1,
        backend="tpu_inductor",
        dynamic=False,
        options={"dump_dir": str(tmp_path), "cache": False},
    )
    with caplog.at_level(logging.INFO, logger="tpu_inductor.debug.recompiles"):
        for n in (4, 6):
            x = torch.randn(n, 3)
            assert_same(fn(x), x * 2 + 1)
    compiles = report.load_run(tmp_path)
    assert [c["recompile_reason"] is None for c in compiles] == [True, False]
    assert "size 4 → 6 at dim 0" in compiles[1]["recompile_reason"]
    assert "torch._dynamo.mark_dynamic(input, 0)" in compiles[1]["recompile_reason"]
    assert f"({compiles[1]['graph']}, the same graph as {compiles[0]['graph']})" in caplog.text
