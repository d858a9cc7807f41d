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
    assert retrace.startswith("Dynamo traced it again, with symbolic sizes: input 3 ")
    assert "input 3 (float32[2, 4] → float32[5, 4]): dim 0: 2 → 5" in retrace
    assert "torch._dynamo.mark_dynamic(input, 0) before the first call" in retrace
    # Size 7: the symbolic graph compiled for one more size.
    reason = forward[-1]["recompile_reason"]
    assert "input 3 (float32[5, 4] → float32[7, 4]): dim 0: 5 → 7" in reason
    assert "input 2 (a symbolic size or number): 5 → 7" in reason
    assert "pad input 3's dim 0 to a few fixed sizes, one compile each" in reason
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
    assert again.startswith("input 0 (a symbolic size or number): 3 → 4.")
    assert "pass a number that varies and sets no size as a 0-d tensor" in again


def test_explain_recompile_texts():
    old = (((8, 16), "torch.float32"), 3)
    new = (((12, 16), "torch.float32"), 3)
    assert recompiles.explain_recompile(old, new, same_graph=False) == (
        "input 0 (float32[8, 16] → float32[12, 16]): dim 0: 8 → 12. To avoid it: pad input 0's "
        "dim 0 to a few fixed sizes, one compile each (torch._dynamo.mark_dynamic(input, 0) "
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
    assert "dim 0: 4 → 6" in compiles[1]["recompile_reason"]
    assert "torch._dynamo.mark_dynamic(input, 0)" in compiles[1]["recompile_reason"]
    assert f"({compiles[1]['graph']}, the same graph as {compiles[0]['graph']})" in caplog.text
