"""The compile-cache key (cache/key.py): an option enters it by its declaration alone, the
passes have one identity for both caches, and a miss is explained entry by entry."""

from __future__ import annotations

import dataclasses

import torch

from tpu_inductor.cache import aot_autograd, key
from tpu_inductor.config import Options, _knob
from tpu_inductor.runtime import devices


@dataclasses.dataclass(frozen=True)
class _Options(Options):
    """Options with two knobs that no module but this one names."""

    # Changes the compiled code: in the key by its declaration, nothing else.
    unroll: int = _knob(1, minimum=1)
    # Never changes it: declared so.
    chatter: int = _knob(0, in_key=False)


def _key(options: Options) -> key.CacheKey:
    graph = key.for_graph("a graph", [torch.zeros(2, 3)])
    return key.for_compile(graph, options, devices.select_device(options.device))


def test_an_option_declared_once_changes_the_key_and_names_itself():
    base, unrolled = _key(_Options.from_user()), _key(_Options.from_user({"unroll": 2}))
    assert unrolled.digest != base.digest
    assert base.explain(unrolled) == ["options.unroll"]


def test_an_option_declared_out_of_the_key_leaves_it_alone(monkeypatch):
    base = _key(_Options.from_user())
    assert _key(_Options.from_user({"chatter": 3})) == base
    monkeypatch.setenv("TPU_INDUCTOR_CHATTER", "4")  # from its environment variable too
    assert _Options.from_user().chatter == 4 and _key(_Options.from_user()) == base


def test_graph_entries_explain_a_miss():
    one = key.for_graph("g", [torch.zeros(2, 3)])
    assert one == key.for_graph("g", [torch.zeros(2, 3)])
    assert one.explain(key.for_graph("g", [torch.zeros(3, 2)])) == ["inputs", "strides"]
    assert one.explain(key.for_graph("g", [torch.zeros(2, 3)], donate_writes=True)) == [
        "donate_writes"
    ]


def test_passes_have_one_identity_in_both_caches():
    """Our key's context is what AOTAutograd's backend id digests: the passes' identity
    (passes/pipeline.identity) is in both, and a setting a pass reads changes it."""
    options = Options.from_user()
    device = devices.select_device(options.device)
    context = key.CacheKey.of(key.context_entries(options, device))
    assert aot_autograd.backend_id(options) == "tpu_inductor-" + context.digest
    assert _key(options).entries[-len(context.entries) :] == context.entries
    fused = Options.from_user({"fusion": {"attention": True}})
    differ = _key(options).explain(_key(fused))
    assert "pass.fuse_attention" in differ and "pass.cleanup" not in differ
    disabled = Options.from_user({"disable_passes": ["cleanup"]})
    assert "pass.cleanup" in _key(options).explain(_key(disabled))
