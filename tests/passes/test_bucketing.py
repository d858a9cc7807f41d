"""Shape bucketing end to end (passes/bucket_shapes.py, tpu_inductor/runtime/buckets.py): a graph with
symbolic sizes compiles once per bucket, not per size, and every result equals eager's at the
true sizes — with the padding filled with NaN and the largest integer (`pad_with="nan"`), so a
padded value that reached a real position would show. Compiles are counted (PJRT compiles are
what a TPU pays seconds to minutes for), not timed."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from hypothesis import example, given
from hypothesis import strategies as st

from tests.helpers import assert_same, grads_of
from tests.strategies import PROPERTY
from tpu_inductor.exc import OptionError
from tpu_inductor.runtime import buckets as bucketing
from tpu_inductor.runtime import devices

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

NAN_PADDING = {"pad_with": "nan"}
POLICIES = [
    {"policy": "pow2", **NAN_PADDING},
    {"policy": "pow2", "min_bucket": 16, **NAN_PADDING},
    {"policy": "multiple", "multiple": 8, **NAN_PADDING},
    {"policy": "sizes", "sizes": [4, 16, 40], **NAN_PADDING},
    {"policy": "pow2", "pad_with": "inf"},  # +inf: what a max or a softmax would let through
]


def _compile(fn, shapes, **kwargs):
    options = {"shapes": shapes, "fallback": "error"}
    return torch.compile(fn, backend="tpu_inductor", options=options, **kwargs)


def _compiles() -> int:
    return devices.stats["pjrt_compiles"]


def _ops(x, w, table, ids):
    """An op of every kind the pass masks, reading across the padded dim 1 of x [b, s, 8]."""
    h = torch.tanh(x @ w)  # [b, s, 8]
    e = table[ids]  # embedding of padded indices
    return (
        h.sum(1),
        h.mean(1),
        h.softmax(1),
        h.log_softmax(1),
        h.amax(1),
        x.argmax(1),  # of the inputs: computed values may tie to an ulp
        torch.logsumexp(h, 1),
        h.cumsum(1),
        h.transpose(1, 2) @ h,  # contraction over the padded dim
        F.layer_norm(h, (8,)),
        e.sum(1),
        h[:, 1:].sum(1),  # a shifted slice: one fewer real position
        F.pad(ids, (0, 1), value=-7),  # a value right after the true end
        h.reshape(-1, 8).sum(0),  # the padded dim merged with the batch
        torch.topk(x, 3, dim=-1),  # along an unpadded dim (a router's), of the inputs (no ties)
    )


@PROPERTY
@given(
    batch=st.integers(1, 3),
    lengths=st.lists(st.integers(2, 40), min_size=2, max_size=4),
    shapes=st.sampled_from(POLICIES),
)
@example(batch=2, lengths=[3, 5, 17, 33], shapes=POLICIES[0])
@example(batch=2, lengths=[3, 5, 17, 33], shapes=POLICIES[-1])
def test_every_masked_op_equals_eager_at_the_true_sizes(batch, lengths, shapes):
    torch._dynamo.reset()
    w, table = torch.randn(8, 8), torch.randn(50, 4)
    compiled = _compile(_ops, shapes)
    for n in lengths:
        x, ids = torch.randn(batch, n, 8), torch.randint(0, 50, (batch, n))
        torch._dynamo.maybe_mark_dynamic(x, 1)
        torch._dynamo.maybe_mark_dynamic(ids, 1)
        for got, want in zip(compiled(x, w, table, ids), _ops(x, w, table, ids)):
            assert_same(got, want, atol=1e-5, rtol=1e-4)
    assert bucketing.report()[-1]["buckets"], "the graph was not bucketed"


def _gpt2():
    """The zoo's GPT-2 (seeded, dropout off), with positions for lengths up to 256."""
    from tests import hf_zoo

    return hf_zoo.build("gpt2", hf_zoo.Size(seq=128))[0]


def test_gpt2_lengths_compile_three_times_under_pow2():
    """17, 31, 64, 100, 128, 77: buckets 32, 64, 128, equal to eager (NaN in the padding)."""
    model = _gpt2().eval()
    compiled = _compile(model, {"policy": "pow2", **NAN_PADDING})
    before = _compiles()
    with torch.no_grad():
        for n in (17, 31, 64, 100, 128, 77):
            ids = torch.randint(0, 100, (4, n))
            torch._dynamo.maybe_mark_dynamic(ids, 1)
            assert_same(compiled(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-4)
    assert _compiles() - before <= 3
    served = bucketing.report()[-1]["buckets"]
    assert set(served) == {"(32,)", "(64,)", "(128,)"}, served


def test_a_ragged_last_batch_compiles_nothing_new():
    model = _gpt2().eval()
    compiled = _compile(model, {"policy": "pow2", **NAN_PADDING}, dynamic=True)
    with torch.no_grad():
        for b in (4, 4):
            ids = torch.randint(0, 100, (b, 20))
            compiled(ids)
        before = _compiles()
        ids = torch.randint(0, 100, (3, 20))
        assert_same(compiled(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-4)
    assert _compiles() == before


def test_gpt2_training_step_equals_eager():
    """Loss and every gradient at three lengths of one bucket: the model's and the loss's
    forward and backward graphs compile once each."""
    torch.manual_seed(0)
    model, reference = _gpt2().train(), _gpt2().train()
    reference.load_state_dict(model.state_dict())
    compiled = _compile(model, {"policy": "pow2", **NAN_PADDING})
    before = _compiles()
    for n in (17, 31, 20):
        ids = torch.randint(0, 100, (2, n))
        torch._dynamo.maybe_mark_dynamic(ids, 1)
        loss, want = compiled(ids, labels=ids).loss, reference(ids, labels=ids).loss
        assert_same(loss, want, atol=1e-5, rtol=1e-4)
        got, expected = grads_of(model, loss), grads_of(reference, want)
        for name in expected:
            assert_same(got[name], expected[name], atol=1e-5, rtol=1e-4)
    assert _compiles() - before <= 4


def test_a_graph_the_pass_cannot_prove_exact_compiles_per_size_and_says_why(caplog):
    def f(x):
        return torch.sort(x, dim=0).values * 2  # sort has no padding rule

    compiled = _compile(f, {"policy": "pow2", **NAN_PADDING}, dynamic=True)
    with caplog.at_level(logging.INFO, logger="tpu_inductor.passes.bucket_shapes"):
        for n in (3, 5):
            x = torch.randn(n, 4)
            assert_same(compiled(x), f(x))
    assert "not bucketing" in caplog.text and "sort" in caplog.text


@pytest.mark.parametrize(
    "shapes, message",
    [
        ({"policy": "buckets"}, "allowed values"),
        ({"policy": "sizes", "sizes": [64, 32]}, "ascending positive sizes"),
        ({"policy": "multiple", "multiple": 0}, "integer >= 1"),
        ({"pad_with": "ones"}, "allowed values"),
    ],
)
def test_bad_bucketing_options_name_the_key_and_value(shapes, message):
    from tpu_inductor.config import Options

    with pytest.raises(OptionError, match=message):
        Options.from_user({"shapes": shapes})


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generate_with_the_dynamic_cache_makes_the_same_tokens_in_few_compiles(name):
    """Prompts of four lengths, 32 new tokens each: one graph for the prompts, one for the
    decode steps (the KV cache grows by one a step); at most 8 PJRT compiles (74 per exact size
    before bucketing)."""
    from tests import hf_zoo

    model, _ = hf_zoo.build(name, hf_zoo.Size(seq=64))
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    prompts = [torch.randint(1, 100, (1, n)) for n in (5, 9, 13, 20)]
    expected = [model.generate(p, max_new_tokens=32, do_sample=False) for p in prompts]
    model.forward = _compile(model.forward, {"policy": "pow2"})
    before = _compiles()
    for prompt, want in zip(prompts, expected):
        assert torch.equal(model.generate(prompt, max_new_tokens=32, do_sample=False), want)
    assert _compiles() - before <= 8


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "t5"])
def test_hugging_face_models_are_bucketed_and_exact(name):
    """Inference at five lengths, NaN in the padding: eager's results, at most 3 compiles."""
    from tests import hf_zoo

    model, inputs = hf_zoo.build(name, hf_zoo.Size(seq=32))
    compiled = _compile(model, {"policy": "pow2", **NAN_PADDING})
    before = _compiles()
    with torch.no_grad():
        for n in (5, 9, 13, 20, 7):
            kwargs = {
                k: v[:, :n].clone() if k.endswith("input_ids") else v for k, v in inputs.items()
            }
            for key, value in kwargs.items():
                if key.endswith("input_ids"):
                    torch._dynamo.maybe_mark_dynamic(value, 1)
            got, want = compiled(**kwargs), model(**kwargs)
            for key in want.keys():
                if isinstance(want[key], torch.Tensor):
                    assert_same(got[key], want[key], atol=1e-5, rtol=1e-4)
    assert _compiles() - before <= 3


def test_precompile_leaves_nothing_to_compile_after_warm_up():
    import tpu_inductor

    model = _gpt2().eval()
    shapes = {"policy": "pow2", "min_bucket": 8}
    compiled = _compile(model, shapes)
    from tpu_inductor.config import Options

    record = Options.from_user({"shapes": shapes}).shapes
    buckets = tpu_inductor.precompile(
        compiled, (torch.randint(0, 100, (2, 5)),), {0: 1}, 64, record
    )
    assert buckets == [8, 16, 32, 64]
    warm = tpu_inductor.compiles()
    with torch.no_grad():
        for n in (3, 9, 17, 33, 64, 50):
            ids = torch.randint(0, 100, (2, n))
            torch._dynamo.maybe_mark_dynamic(ids, 1)
            assert_same(compiled(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-4)
    assert tpu_inductor.compiles() == warm


def test_the_auto_plan_is_chosen_from_the_sizes_seen_and_carries_over(tmp_path):
    """A first run observes the lengths and saves the plan; a later run (a fresh Dynamo, the
    plan read from its file) buckets at its boundaries: less padding than pow2's buckets."""
    import tpu_inductor

    plan = tmp_path / "plan.json"
    shapes = {"policy": "auto", "plan": str(plan), **NAN_PADDING}
    lengths = [20, 21, 22, 23, 40, 41, 42, 20, 21, 40]

    def run():
        torch._dynamo.reset()
        model = _gpt2().eval()
        compiled = _compile(model, shapes)
        with torch.no_grad():
            for n in lengths:
                ids = torch.randint(0, 100, (2, n))
                torch._dynamo.maybe_mark_dynamic(ids, 1)
                assert_same(compiled(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-4)
        return bucketing.report()[-1]

    first = run()  # no plan yet: pow2 (32 and 64)
    assert tpu_inductor.save_plans() == [str(plan)] and plan.exists()
    bucketing.forget_plans()  # as a new process: read from the file
    second = run()
    assert set(first["buckets"]) == {"(32,)", "(64,)"}
    assert {int(b.strip("(,)")) for b in second["buckets"]} <= {23, 42}
    assert second["padded_share"] < first["padded_share"]


def test_compile_json_explain_and_the_recompile_reason_show_buckets(tmp_path):
    from tpu_inductor.debug import report

    def f(x):
        return x.softmax(1).sum(1)

    def g(x):
        return torch.sort(x, dim=1).values

    options = {"shapes": {"policy": "pow2"}, "dump_dir": str(tmp_path), "fallback": "error"}
    for fn in (f, g):
        compiled = torch.compile(fn, backend="tpu_inductor", options=options)
        for n in (3, 5, 6, 9):
            x = torch.randn(2, n)
            torch._dynamo.maybe_mark_dynamic(x, 1)
            assert_same(compiled(x), fn(x))
    text = report.explain(tmp_path)
    assert (
        "bucket {\"L['x'].size()[1]\": 4} (pow2) for true sizes {\"L['x'].size()[1]\": 3}, 25% "
        "of the input padding" in text
    )
    assert "bucket {\"L['x'].size()[1]\": 16}" in text  # 9: a new bucket, explained
    assert "A new bucket" in text
    assert "not bucketed: " in text and "sort" in text
    shares = {  # compile.json: each bucket's true sizes and the padded share of their call
        (c["bucketing"]["bucket"]["L['x'].size()[1]"], c["bucketing"]["padded_share"])
        for c in report.load_run(tmp_path)
        if c.get("bucketing") and "bucket" in c["bucketing"]
    }
    assert shares == {(4, 0.25), (8, 0.375), (16, 0.4375)}  # 3 of 4, 5 of 8, 9 of 16


def test_bucketed_results_equal_the_exact_size_compile_to_a_few_ulp():
    """The same graph compiled per exact size and per pow2 bucket: integer results identical,
    floating ones within 16 ulp of each result's scale (sums over a padded dim add the same
    real terms, in another order)."""
    w, table = torch.randn(8, 8), torch.randn(50, 4)
    results = {}
    for policy in ("exact", "pow2"):
        torch._dynamo.reset()
        compiled = _compile(_ops, {"policy": policy, **NAN_PADDING})
        runs = []
        for n in (3, 5, 17, 33):
            g = torch.Generator().manual_seed(n)
            x, ids = torch.randn(2, n, 8, generator=g), torch.randint(0, 50, (2, n), generator=g)
            torch._dynamo.maybe_mark_dynamic(x, 1)
            torch._dynamo.maybe_mark_dynamic(ids, 1)
            runs.append(compiled(x, w, table, ids))
        results[policy] = runs
    for exact, bucketed in zip(results["exact"], results["pow2"]):
        for a, b in zip(pytree.tree_leaves(exact), pytree.tree_leaves(bucketed), strict=True):
            if not a.dtype.is_floating_point:
                assert torch.equal(a, b)
                continue
            scale = a.abs().max().clamp_min(torch.finfo(a.dtype).tiny)
            assert (a - b).abs().max() <= 16 * torch.finfo(a.dtype).eps * scale


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_a_training_step_with_an_attention_mask_equals_eager(name):
    """Loss and every gradient at three lengths of one bucket, a masked prefix in one row, NaN
    in the padding: one forward and one backward compile."""
    from tests import hf_zoo

    model, inputs = hf_zoo.build(name, hf_zoo.Size(seq=32))
    reference, _ = hf_zoo.build(name, hf_zoo.Size(seq=32))
    model.train(), reference.train()
    compiled = _compile(model, {"policy": "pow2", **NAN_PADDING})
    before = _compiles()
    for n in (9, 13, 11):
        kwargs = {k: v[:, :n].clone() if k.endswith("input_ids") else v for k, v in inputs.items()}
        kwargs["attention_mask"] = torch.ones(2, n, dtype=torch.long)
        kwargs["attention_mask"][0, :3] = 0
        for key in ("input_ids", "attention_mask"):
            torch._dynamo.maybe_mark_dynamic(kwargs[key], 1)
        if name != "bert":
            kwargs["labels"] = kwargs["input_ids"]
        got, want = compiled(**kwargs), reference(**kwargs)
        loss = got.loss if name != "bert" else got.logits.square().mean()
        expected = want.loss if name != "bert" else want.logits.square().mean()
        assert_same(loss, expected, atol=1e-5, rtol=1e-4)
        grads, expected_grads = grads_of(model, loss), grads_of(reference, expected)
        for key in expected_grads:
            assert_same(grads[key], expected_grads[key], atol=1e-5, rtol=1e-4)
    assert _compiles() - before <= 2


def test_a_bucket_never_passes_a_bound_the_graph_implies():
    """A table sliced to the length (positions: 20 rows), positions looked up in a table and
    mark_dynamic(max=40) bound the bucket: pow2 would pad 17 to 32 and 33 to 64, past what the
    graph can take."""
    table = torch.randn(20, 4)

    def positions(x):
        return (x + table[: x.shape[1]]).softmax(1)

    def capped(x):
        return x.softmax(1).sum(1)

    def embedded(x):  # positions 2.. looked up: 18 rows of 20 are left for them
        return (x + F.embedding(torch.arange(x.shape[1]) + 2, table)).softmax(1)

    for fn, lengths, mark, bucket in (
        (positions, (17, 19, 20), torch._dynamo.maybe_mark_dynamic, "(20,)"),
        (embedded, (17, 18), torch._dynamo.maybe_mark_dynamic, "(18,)"),
        (capped, (33, 39), lambda x, d: torch._dynamo.mark_dynamic(x, d, min=2, max=40), "(40,)"),
    ):
        torch._dynamo.reset()
        compiled = _compile(fn, {"policy": "pow2", **NAN_PADDING})
        before = _compiles()
        for n in lengths:
            x = torch.randn(2, n, 4)
            mark(x, 1)
            assert_same(compiled(x), fn(x), atol=1e-6, rtol=1e-5)
        assert set(bucketing.report()[-1]["buckets"]) == {bucket}
        assert _compiles() - before == 1


def test_gpt2s_position_table_bounds_its_bucket():
    """GPT-2 with 64 positions under multiple=48: 50 and 60 pad to 64 (the table's end), not
    96; one compile, equal to eager with NaN in the padding."""
    from tests import hf_zoo

    model = hf_zoo.build("gpt2", hf_zoo.Size(seq=32))[0]
    compiled = _compile(model, {"policy": "multiple", "multiple": 48, **NAN_PADDING})
    before = _compiles()
    with torch.no_grad():
        for n in (50, 60):
            ids = torch.randint(0, 100, (2, n))
            torch._dynamo.maybe_mark_dynamic(ids, 1)
            assert_same(compiled(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-4)
    assert set(bucketing.report()[-1]["buckets"]) == {"(64,)"}
    assert _compiles() - before == 1
