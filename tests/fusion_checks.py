"""Checks every fusion pass owes (issue 22's rule for a rewrite: in the dumps with a diff,
switchable by an option that is validated and in the cache key), shared by the passes' tests."""

from __future__ import annotations

import pytest
import torch
from tpu_inductor.passes import pipeline

from tpu_inductor import report
from tpu_inductor.config import Options
from tpu_inductor.exc import OptionError

from . import hf_zoo


def assert_dumped_rewrite(tmp_path, option: str, rewrites: dict, added: tuple, removed: tuple):
    """The zoo Llama compiled with `fusion.<option>` on dumps the pass's graph and its diff:
    the rewrite counts `rewrites`, `added` = (op name, count) on added lines, `removed` alike."""
    pass_name = f"fuse_{option}"
    model, kwargs = hf_zoo.build("llama")
    torch._dynamo.reset()
    options = {"cache": False, "fallback": "error", "fusion": {option: True}}
    with torch.no_grad():
        torch.compile(
            model, backend="tpu_inductor", options={**options, "dump_dir": str(tmp_path)}
        )(**kwargs)
    (c,) = report.load_run(tmp_path)
    assert c["pass_rewrites"][pass_name] == rewrites
    diff = next(f for f in c["files"] if f.endswith(f"_pass_{pass_name}.diff"))
    text = (tmp_path / c["folder"] / diff).read_text()
    assert text.startswith(f"# pass {pass_name}: rewrites {rewrites}")
    for sign, (op, count) in (("+ ", added), ("- ", removed)):
        lines = [line for line in text.splitlines() if line.startswith(sign)]
        assert sum(op in line for line in lines) == count, (sign, op)


def assert_option_validated_and_keyed(option: str):
    """`fusion.<option>` is off by default, refuses a non-bool, and is in the cache key."""
    off, on = Options.from_user({}), Options.from_user({"fusion": {option: True}})
    assert pipeline.fingerprint(on) != pipeline.fingerprint(off)
    assert on.cache_key_entries() != off.cache_key_entries()
    assert getattr(off.fusion, option) is False
    with pytest.raises(OptionError, match=option):
        Options.from_user({"fusion": {option: "yes"}})
