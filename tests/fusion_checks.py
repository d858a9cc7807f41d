"""Checks every fusion pass owes (issue 22's rule for a rewrite: in the dumps with a diff,
switchable by an option that is validated and in the cache key), shared by the passes' tests."""

from __future__ import annotations

import collections

import pytest
import torch
from tpu_inductor.passes import pipeline

from tpu_inductor.config import FUSION_DEFAULTS, Options
from tpu_inductor.debug import report
from tpu_inductor.exc import OptionError

from . import hf_zoo
from .helpers import assert_same, grads_of


def rewrites_since(option: str, before) -> dict[str, int]:
    """The rewrites pass `fuse_<option>` counted since `before` (a copy of pipeline.counters)."""
    prefix = f"fuse_{option}."
    return {
        key.removeprefix(prefix): count - before[key]
        for key, count in pipeline.counters.items()
        if key.startswith(prefix) and count > before[key]
    }


def llama_trained_at_two_lengths(options: dict, option: str) -> dict[str, int]:
    """The zoo Llama trained at lengths 8 and 11 with dynamic=True under `options`: logits and
    every gradient equal eager torch's; returns the rewrites of `fuse_<option>`."""
    model, _ = hf_zoo.build("llama")
    torch._dynamo.reset()
    before = collections.Counter(pipeline.counters)
    compiled = torch.compile(model, backend="tpu_inductor", options=options, dynamic=True)
    g = torch.Generator().manual_seed(2)
    for length in (8, 11):
        ids = torch.randint(0, hf_zoo.VOCAB, (2, length), generator=g)
        out, expected = (m(input_ids=ids, labels=ids, use_cache=False) for m in (compiled, model))
        assert_same(out.logits, expected.logits)
        assert_same(grads_of(model, out.loss), grads_of(model, expected.loss))
    return rewrites_since(option, before)


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
    (c,) = [c for c in report.load_run(tmp_path) if c["pass_rewrites"]]  # not a hoisted prologue
    assert c["pass_rewrites"][pass_name] == rewrites
    diff = next(f for f in c["files"] if f.endswith(f"_pass_{pass_name}.diff"))
    text = (tmp_path / c["folder"] / diff).read_text()
    assert text.startswith(f"# pass {pass_name}: rewrites {rewrites}")
    for sign, (op, count) in (("+ ", added), ("- ", removed)):
        lines = [line for line in text.splitlines() if line.startswith(sign)]
        assert sum(op in line for line in lines) == count, (sign, op)


def assert_option_validated_and_keyed(option: str):
    """`fusion.<option>` left unset is the platform's default (off on the CPU, as
    FUSION_DEFAULTS says elsewhere), refuses a non-bool, and is in the cache key."""
    unset, on = Options.from_user({}), Options.from_user({"fusion": {option: True}})
    off = unset.on_platform("cpu")
    assert getattr(unset.fusion, option) is None and getattr(off.fusion, option) is False
    assert pipeline.identity(on) != pipeline.identity(off)
    assert on.cache_key_entries() != off.cache_key_entries()
    for platform, defaults in FUSION_DEFAULTS.items():
        assert getattr(unset.on_platform(platform).fusion, option) is defaults[option]
        assert getattr(on.on_platform(platform).fusion, option) is True
    with pytest.raises(OptionError, match=option):
        Options.from_user({"fusion": {option: "yes"}})
