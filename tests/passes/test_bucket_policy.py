"""The bucketing policy (passes/bucket_policy.py): which bucket a size compiles at, the `auto`
policy's boundaries against a brute-force optimum, the joint (batch x length) search, the plan
file and the option's parsing. Pure policy: nothing is compiled."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from tpu_inductor.passes.bucket_policy import (
    DEFAULT_COMPILE_COST,
    PLAN_FORMAT,
    PLAN_VERSION,
    BucketPlan,
    BucketPlanError,
    BucketPolicy,
    choose_boundaries,
    choose_joint,
    parse_policy,
)

from tests.strategies import PROPERTY, seeds
from tpu_inductor.exc import OptionError

ascending_sizes = st.lists(st.integers(1, 3000), min_size=1, max_size=12, unique=True).map(
    lambda s: tuple(sorted(s))
)
policies = st.one_of(
    st.just(BucketPolicy("exact")),
    st.builds(BucketPolicy, st.just("pow2"), min_bucket=st.integers(1, 100)),
    st.builds(BucketPolicy, st.just("multiple"), multiple=st.integers(1, 300)),
    st.builds(BucketPolicy, st.just("sizes"), sizes=ascending_sizes),
    st.builds(BucketPolicy, st.just("auto"), min_bucket=st.integers(1, 64)),
    st.builds(BucketPolicy, st.just("auto"), sizes=ascending_sizes),
)
bounds = st.none() | st.integers(0, 4000)
costs = st.sampled_from([0, 0.5, 1, 3, 17.25, 100, 2500, DEFAULT_COMPILE_COST])


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _work(policy: BucketPolicy, histogram: dict[int, int]) -> int:
    return sum(count * (policy.bucket(size) - size) for size, count in histogram.items())


def _brute_force(histogram, max_buckets, compile_cost, bound=None):
    """The least (cost, bucket count, boundaries) over every subset of the served sizes that
    holds the largest: the definition `choose_boundaries` must meet."""
    served = sorted(
        s for s, c in histogram.items() if c and s >= 2 and (bound is None or s <= bound)
    )
    if not served:
        return ()
    best = None
    for k in range(1, min(max_buckets, len(served)) + 1):
        for rest in itertools.combinations(served[:-1], k - 1):
            chosen = rest + (served[-1],)
            pad = sum(histogram[s] * (min(b for b in chosen if b >= s) - s) for s in served)
            key = (pad + compile_cost * k, k, chosen)
            best = key if best is None or key < best else best
    return best[2]


# --- BucketPolicy.bucket -------------------------------------------------------------------


@PROPERTY
@given(policy=policies, size=st.integers(0, 4000), step=st.integers(0, 600), bound=bounds)
@example(policy=BucketPolicy("pow2"), size=100, step=1, bound=100)
@example(policy=BucketPolicy("pow2"), size=101, step=0, bound=100)
@example(policy=BucketPolicy("sizes", sizes=(64, 128)), size=129, step=1, bound=None)
@example(policy=BucketPolicy("multiple", multiple=7), size=0, step=1, bound=None)
@example(policy=BucketPolicy("auto", sizes=(10, 20)), size=15, step=5, bound=12)
def test_bucket_holds_the_size_within_the_bound_monotone_idempotent(policy, size, step, bound):
    b = policy.bucket(size, bound)
    assert b >= size
    if bound is not None and size <= bound:
        assert b <= bound
    if size <= 1:
        assert b == size  # never padded: torch specializes 0 and 1
    assert policy.bucket(size + step, bound) >= b  # monotone
    assert policy.bucket(b, bound) == b  # idempotent: a padded input keeps its bucket


@pytest.mark.parametrize(
    "policy, size, bound, expected",
    [
        (BucketPolicy("pow2"), 2, None, 16),
        (BucketPolicy("pow2"), 16, None, 16),
        (BucketPolicy("pow2"), 17, None, 32),
        (BucketPolicy("pow2", min_bucket=20), 3, None, 32),
        (BucketPolicy("pow2", min_bucket=1), 3, None, 4),
        (BucketPolicy("pow2"), 1, None, 1),
        (BucketPolicy("pow2"), 0, None, 0),
        (BucketPolicy("pow2"), 70, 100, 100),  # clamped to the bound
        (BucketPolicy("pow2"), 101, 100, 101),  # past the bound: exactly
        (BucketPolicy("exact"), 37, None, 37),
        (BucketPolicy("multiple"), 2, None, 128),
        (BucketPolicy("multiple"), 129, None, 256),
        (BucketPolicy("multiple", multiple=10), 30, None, 30),
        (BucketPolicy("sizes", sizes=(64, 128)), 64, None, 64),
        (BucketPolicy("sizes", sizes=(64, 128)), 65, None, 128),
        (BucketPolicy("sizes", sizes=(64, 128)), 129, None, 129),  # past the largest: exactly
        (BucketPolicy("sizes", sizes=(64, 128)), 100, 90, 100),
        (BucketPolicy("sizes", sizes=(64, 128)), 80, 90, 90),
        (BucketPolicy("auto"), 17, None, 32),  # no plan: as pow2
        (BucketPolicy("auto", sizes=(40, 300)), 41, None, 300),
    ],
)
def test_bucket_examples(policy, size, bound, expected):
    assert policy.bucket(size, bound) == expected


@PROPERTY
@given(min_bucket=st.integers(1, 300), size=st.integers(2, 5000))
@example(min_bucket=16, size=2)
@example(min_bucket=17, size=17)
@example(min_bucket=64, size=65)
def test_pow2_is_the_power_of_two_at_least_min_and_size(min_bucket, size):
    assert BucketPolicy("pow2", min_bucket=min_bucket).bucket(size) == _pow2_at_least(
        max(_pow2_at_least(min_bucket), size)
    )


@PROPERTY
@given(policy=policies, largest=st.integers(0, 2000), bound=bounds)
@example(policy=BucketPolicy("pow2"), largest=300, bound=200)
@example(policy=BucketPolicy("exact"), largest=5, bound=None)
def test_buckets_up_to_lists_every_bucket_in_use(policy, largest, bound):
    expected = sorted({policy.bucket(s, bound) for s in range(2, largest + 1)})
    assert policy.buckets_up_to(largest, bound) == expected


def test_bad_fields_and_sizes_are_refused():
    for kwargs in (
        {"kind": "pow3"},
        {"kind": "pow2", "min_bucket": 0},
        {"kind": "multiple", "multiple": -4},
    ):
        with pytest.raises(OptionError):
            BucketPolicy(**kwargs)
    with pytest.raises(OptionError, match="ascending"):
        BucketPolicy("sizes", sizes=(8, 8))
    with pytest.raises(OptionError, match="ascending"):
        BucketPolicy("sizes")
    with pytest.raises(ValueError, match="-1"):
        BucketPolicy("pow2").bucket(-1)
    with pytest.raises(ValueError, match="bound"):
        BucketPolicy("pow2").bucket(5, bound=-3)


# --- choose_boundaries ---------------------------------------------------------------------

small_histograms = st.dictionaries(st.integers(0, 80), st.integers(1, 30), min_size=1, max_size=7)


@PROPERTY
@given(
    histogram=small_histograms,
    max_buckets=st.integers(1, 8),
    cost=costs,
    bound=st.none() | st.integers(0, 80),
)
@example(histogram={2: 1, 4: 1}, max_buckets=8, cost=2, bound=None)  # tie: fewer buckets
@example(histogram={2: 1, 3: 1, 4: 1}, max_buckets=2, cost=0, bound=None)  # tie: smaller boundaries
@example(histogram={0: 5, 1: 9}, max_buckets=3, cost=0, bound=None)  # nothing to pad
@example(histogram={3: 5, 10: 1, 100: 2, 120: 4}, max_buckets=8, cost=50, bound=110)
@example(
    histogram={5: 2, 9: 1, 30: 7, 31: 1, 60: 3, 61: 2, 80: 1}, max_buckets=3, cost=17.25, bound=None
)
def test_choose_boundaries_is_the_brute_force_optimum(histogram, max_buckets, cost, bound):
    got = choose_boundaries(histogram, max_buckets=max_buckets, compile_cost=cost, bound=bound)
    assert got == _brute_force(histogram, max_buckets, cost, bound)


def test_choose_boundaries_breaks_ties_as_documented():
    assert choose_boundaries({2: 1, 4: 1}, compile_cost=2) == (4,)
    assert choose_boundaries({2: 1, 3: 1, 4: 1}, max_buckets=2, compile_cost=0) == (2, 4)


def test_choose_boundaries_is_exact_past_int64():
    """Counts so large the work leaves int64: exact integers still, the same optimum."""
    histogram = {2: 2**61, 3: 2**61 + 1, 7: 3, 40: 2**60}
    got = choose_boundaries(histogram, max_buckets=2, compile_cost=5)
    assert got == _brute_force(histogram, 2, 5) == (3, 40)


@PROPERTY
@given(
    histogram=st.dictionaries(st.integers(0, 1000), st.integers(0, 50), min_size=1, max_size=40),
    max_buckets=st.integers(1, 10),
    cost=costs,
    bound=st.none() | st.integers(0, 1000),
)
@example(histogram={5: 1, 900: 3}, max_buckets=1, cost=0, bound=500)
def test_choose_boundaries_respects_max_buckets_and_bound(histogram, max_buckets, cost, bound):
    got = choose_boundaries(histogram, max_buckets=max_buckets, compile_cost=cost, bound=bound)
    served = {s for s, c in histogram.items() if c and s >= 2 and (bound is None or s <= bound)}
    assert len(got) <= max_buckets
    assert list(got) == sorted(set(got))
    assert set(got) <= served  # boundaries are observed sizes, none past the bound
    assert (got[-1] if got else None) == (max(served) if served else None)  # the largest
    auto = BucketPolicy("auto", sizes=got)
    assert all(auto.bucket(s) in got for s in served)  # every served size has a bucket


@PROPERTY
@given(histogram=small_histograms, extra=st.integers(0, 3))
def test_free_compiles_give_every_distinct_size(histogram, extra):
    distinct = sorted(s for s in histogram if s >= 2)
    got = choose_boundaries(histogram, max_buckets=max(len(distinct), 1) + extra, compile_cost=0)
    assert got == tuple(distinct)


@PROPERTY
@given(seed=seeds())
@example(seed=0)
def test_auto_pads_less_than_pow2_with_no_more_buckets(seed):
    rng = random.Random(seed)
    histogram: dict[int, int] = {}
    for _ in range(200):
        n = rng.randint(1, 512)
        histogram[n] = histogram.get(n, 0) + 1
    pow2 = BucketPolicy("pow2")
    pow2_buckets = len({pow2.bucket(s) for s in histogram if s >= 2})
    free = BucketPolicy(
        "auto", sizes=choose_boundaries(histogram, max_buckets=pow2_buckets, compile_cost=0)
    )
    assert len(free.sizes) <= pow2_buckets
    assert _work(free, histogram) < _work(pow2, histogram)
    # At the default price of a compile, auto's total cost is never above pow2's either.
    priced = BucketPolicy(
        "auto",
        sizes=choose_boundaries(
            histogram, max_buckets=pow2_buckets, compile_cost=DEFAULT_COMPILE_COST
        ),
    )
    assert len(priced.sizes) <= pow2_buckets
    total = _work(priced, histogram) + DEFAULT_COMPILE_COST * len(priced.sizes)
    assert total <= _work(pow2, histogram) + DEFAULT_COMPILE_COST * pow2_buckets


def test_search_arguments_are_checked():
    for kwargs in (
        {"max_buckets": 0},
        {"compile_cost": -1},
        {"compile_cost": float("nan")},
        {"compile_cost": True},
    ):
        with pytest.raises(OptionError):
            choose_boundaries({4: 1}, **{"compile_cost": 1.0, **kwargs})
    with pytest.raises(ValueError, match="count"):
        choose_boundaries({4: -1}, compile_cost=1.0)


# --- choose_joint --------------------------------------------------------------------------

joint_histograms = st.dictionaries(
    st.tuples(st.integers(2, 64), st.integers(2, 512)), st.integers(1, 20), min_size=1, max_size=25
)


def _joint(histogram, bb, bl):
    pb, pl = BucketPolicy("auto", sizes=bb), BucketPolicy("auto", sizes=bl)
    pairs = {(pb.bucket(b), pl.bucket(n)) for b, n in histogram}
    work = sum(c * (pb.bucket(b) * pl.bucket(n) - b * n) for (b, n), c in histogram.items())
    return pairs, work


@PROPERTY
@given(histogram=joint_histograms, max_buckets=st.integers(1, 8), cost=costs)
@example(histogram={(2, 100): 50, (2, 110): 50, (8, 500): 1}, max_buckets=2, cost=0)
def test_choose_joint_uses_at_most_max_buckets_pairs(histogram, max_buckets, cost):
    bb, bl = choose_joint(histogram, max_buckets=max_buckets, compile_cost=cost)
    pairs, work = _joint(histogram, bb, bl)
    assert len(pairs) <= max_buckets
    assert all(
        b <= bb[-1] and n <= bl[-1] for b, n in histogram
    )  # every size is padded, none exact
    one_pair = _joint(histogram, (max(b for b, _ in histogram),), (max(n for _, n in histogram),))
    assert work + cost * len(pairs) <= one_pair[1] + cost  # never worse than one bucket pair


def test_choose_joint_examples():
    histogram = {(2, 100): 50, (2, 110): 50, (8, 500): 1}
    assert choose_joint(histogram, max_buckets=2, compile_cost=0) == ((2, 8), (110, 500))
    # Free compiles and room for every pair: no padding at all.
    assert choose_joint(histogram, max_buckets=3, compile_cost=0) == ((2, 8), (100, 110, 500))
    # Each symbol's candidates weigh its sizes by the other's: (4, 200) pads more elements than
    # (16, 50), so the batch splits at 4, the global optimum (8640 elements; unweighted: 25440).
    skewed = {(4, 200): 3, (16, 50): 4, (32, 16): 5}
    assert choose_joint(skewed, max_buckets=2, compile_cost=0) == ((4, 32), (50, 200))
    assert _joint(skewed, (4, 32), (50, 200)) == ({(4, 200), (32, 50)}, 8640)
    # Sizes 0 and 1 are never padded: three batch buckets force three pairs, the fewest possible.
    forced = {(0, 5): 1, (1, 7): 1, (3, 9): 1}
    bb, bl = choose_joint(forced, max_buckets=1, compile_cost=0)
    assert len(_joint(forced, bb, bl)[0]) == 3


triple_histograms = st.dictionaries(
    st.tuples(st.integers(2, 16), st.integers(2, 300), st.integers(2, 40)),
    st.integers(1, 9),
    min_size=1,
    max_size=20,
)


def _joint_n(histogram, boundaries):
    """The bucket tuples in use and the padded work of `boundaries`, one per symbol."""
    policies = [BucketPolicy("auto", sizes=b) for b in boundaries]
    buckets = {sizes: tuple(p.bucket(s) for p, s in zip(policies, sizes)) for sizes in histogram}
    work = sum(c * (math.prod(buckets[s]) - math.prod(s)) for s, c in histogram.items())
    return set(buckets.values()), work


@PROPERTY
@given(histogram=triple_histograms, max_buckets=st.integers(1, 8), cost=costs)
def test_choose_joint_of_three_symbols_uses_at_most_max_buckets_tuples(
    histogram, max_buckets, cost
):
    chosen = choose_joint(histogram, max_buckets=max_buckets, compile_cost=cost)
    assert len(chosen) == 3
    used, work = _joint_n(histogram, chosen)
    assert len(used) <= max_buckets
    assert all(s <= b[-1] for sizes in histogram for s, b in zip(sizes, chosen))  # none exact
    one = _joint_n(histogram, [(max(s[i] for s in histogram),) for i in range(3)])
    assert work + cost * len(used) <= one[1] + cost  # never worse than one bucket tuple


@PROPERTY
@given(histogram=joint_histograms, size=st.integers(2, 9), at=st.integers(0, 2))
def test_a_symbol_of_one_size_leaves_the_others_joint_boundaries_alone(histogram, size, at):
    """Free compiles: a third symbol always at `size` scales every padded element by `size`,
    so the other two get the boundaries they get alone, and it gets (size,)."""
    pairs = choose_joint(histogram, max_buckets=4, compile_cost=0)
    triples = {(*k[:at], size, *k[at:]): c for k, c in histogram.items()}
    chosen = choose_joint(triples, max_buckets=4, compile_cost=0)
    assert chosen == (*pairs[:at], (size,), *pairs[at:])


def test_choose_joint_examples_of_three_symbols():
    histogram = {(2, 10, 3): 5, (4, 20, 3): 2, (4, 20, 7): 1, (8, 100, 7): 1}
    chosen = choose_joint(histogram, max_buckets=3, compile_cost=0)
    assert chosen == ((4, 8), (20, 100), (3, 7))
    assert _joint_n(histogram, chosen) == ({(4, 20, 3), (4, 20, 7), (8, 100, 7)}, 900)
    assert choose_joint({}, compile_cost=0) == ((), ())
    with pytest.raises(ValueError, match="two or more"):
        choose_joint({(3,): 1}, compile_cost=0)
    with pytest.raises(ValueError, match="two or more"):
        choose_joint({(3, 4): 1, (3, 4, 5): 1}, compile_cost=0)


# --- BucketPlan ----------------------------------------------------------------------------


@PROPERTY
@given(seed=seeds(), keys=st.integers(1, 3), cost=costs)
@example(seed=1, keys=2, cost=DEFAULT_COMPILE_COST)
def test_plan_observe_replan_save_load_round_trip(tmp_path_factory, seed, keys, cost):
    rng = random.Random(seed)
    plan = BucketPlan()
    names = [f"L['input_ids'].size()[{i}]" for i in range(keys)]
    calls = []
    for _ in range(100):  # graphs of one to `keys` symbols
        graph = tuple(rng.sample(names, rng.randint(1, keys)))
        calls.append(graph)
        plan.observe_call(graph, tuple(rng.choice([0, 1, rng.randint(2, 700)]) for _ in graph))
    plan.replan(max_buckets=4, compile_cost=cost)
    for key, hist in plan.histogram.items():
        chosen = choose_boundaries(hist, max_buckets=4, compile_cost=cost)
        assert plan.boundaries.get(key, ()) == chosen
    for pair, hist in plan.joint_histogram.items():
        assert list(pair) == sorted(pair)
        chosen = choose_joint(hist, max_buckets=4, compile_cost=cost)
        assert plan.joint.get(pair, ((),) * len(pair)) == chosen
    assert sum(sum(h.values()) for h in plan.histogram.values()) == sum(map(len, calls))
    joint = sum(sum(h.values()) for h in plan.joint_histogram.values())
    assert joint == sum(len(c) >= 2 for c in calls)
    folder = tmp_path_factory.mktemp("plan")
    path = folder / "deeper" / "plan.json"
    plan.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]  # no temporary left over
    doc = json.loads(path.read_text())
    assert (
        (doc["format"], doc["version"])
        == (PLAN_FORMAT, PLAN_VERSION)
        == ("tpu_inductor.bucket_plan", 2)
    )
    assert BucketPlan.load(path) == plan
    plan.save(path)  # replacing the file
    assert BucketPlan.load(str(path)) == plan


def test_plan_policy_for_and_a_missing_file(tmp_path):
    assert BucketPlan.load(tmp_path / "absent.json") == BucketPlan()
    plan = BucketPlan(boundaries={"s0": (40, 300)})
    base = BucketPolicy("auto", min_bucket=32)
    policy = plan.policy_for("s0", base)
    assert (policy.bucket(41), policy.bucket(300), policy.bucket(301), policy.bucket(1)) == (
        300,
        300,
        301,
        1,
    )
    assert policy.min_bucket == 32
    assert plan.policy_for("s1", base) is base
    plan.observe("s1", 1)  # only unpadded sizes: replanning chooses no boundaries for it
    plan.replan(compile_cost=0)
    assert plan.policy_for("s1", base) is base and "s1" not in plan.boundaries


def test_a_pairs_joint_boundaries_win_over_its_keys():
    plan = BucketPlan(boundaries={"b": (64,), "s": (40, 300)}, joint={("b", "s"): ((4, 32), (50,))})
    base = BucketPolicy("pow2")
    seq, batch = plan.policies_for(("s", "b"), base)  # the graph's order, not the pair's
    assert (seq.bucket(41), batch.bucket(5), seq.bucket(51)) == (50, 32, 51)
    assert plan.policies_for(("s",), base)[0].bucket(41) == 300  # a graph of one symbol
    assert plan.policies_for(("b", "x"), base) == (plan.policy_for("b", base), base)
    plan.observe_call(("s", "b"), (7, 3))
    assert plan.joint_histogram == {("b", "s"): {(3, 7): 1}}
    assert plan.histogram == {"s": {7: 1}, "b": {3: 1}}
    plan.joint[("b", "s", "t")] = ((8,), (64,), (5, 9))  # three symbols, any order
    seq, width, batch = plan.policies_for(("s", "t", "b"), base)
    assert (seq.bucket(41), width.bucket(6), batch.bucket(3)) == (64, 9, 8)
    plan.observe_call(("t", "s", "b"), (6, 41, 3))
    assert plan.joint_histogram[("b", "s", "t")] == {(3, 41, 6): 1}


def _plan_text(joint=(), **symbols):
    doc = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "symbols": symbols}
    return json.dumps({**doc, "joint": list(joint)})


def _joint_entry(symbols=("b", "s"), boundaries=((4,), (64,)), histogram=((3, 9, 1),)):
    return {"symbols": list(symbols), "boundaries": boundaries, "histogram": histogram}


@pytest.mark.parametrize(
    "text, what",
    [
        ("{not json", "JSON"),
        ("", "JSON"),
        (b"\xff\xfe\x00garbage", "JSON"),
        ("[1, 2]", "format"),
        (json.dumps({"format": "other.plan", "version": 1, "symbols": {}}), "other.plan"),
        (json.dumps({"format": PLAN_FORMAT, "version": 1, "symbols": {}}), "version"),
        (json.dumps({"format": PLAN_FORMAT, "version": 3, "symbols": {}}), "version"),
        (json.dumps({"format": PLAN_FORMAT, "version": True, "symbols": {}}), "version"),
        (json.dumps({"format": PLAN_FORMAT, "version": 2, "joint": []}), "symbols"),
        (json.dumps({"format": PLAN_FORMAT, "version": 2, "symbols": {}}), "joint"),
        (json.dumps({"format": PLAN_FORMAT, "version": 2, "symbols": [], "joint": []}), "save"),
        (_plan_text(joint=[_joint_entry(symbols=("s", "b"))]), "sorted"),
        (_plan_text(joint=[_joint_entry(symbols=("b", "s", "t"))]), "as many"),
        (_plan_text(joint=[_joint_entry(symbols=("b",), boundaries=((4,),))]), "2 or more"),
        (_plan_text(joint=[_joint_entry(histogram=((3, 9, 2, 1),))]), "want 2 sizes"),
        (_plan_text(joint=[_joint_entry(boundaries=((8, 4), (64,)))]), "ascending"),
        (_plan_text(joint=[_joint_entry(histogram=((3, 9, -1),))]), "count"),
        (_plan_text(joint=[_joint_entry(histogram=((9, 3, 1), (3, 9, 1)))]), "unsorted"),
        (_plan_text(joint=[_joint_entry(boundaries=((), ()), histogram=())]), "empty"),
        (_plan_text(s={"boundaries": [64, 32], "histogram": []}), "ascending"),
        (_plan_text(s={"boundaries": [64], "histogram": [[3, -1]]}), "count"),
        (_plan_text(s={"boundaries": [64], "histogram": [[3, 1, 2]]}), "save"),
        (_plan_text(s={"boundaries": [64.5], "histogram": []}), "save"),
        (_plan_text(s={"boundaries": [64], "histogram": [[3, 1]], "extra": 1}), "save"),
        (_plan_text(s=[64]), "save"),
    ],
)
def test_an_unusable_plan_file_says_where_what_and_what_to_do(tmp_path, text, what):
    path = tmp_path / "plan.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(BucketPlanError, match="delete it") as info:
        BucketPlan.load(path)
    assert str(path) in str(info.value) and what in str(info.value)
    assert isinstance(info.value, OptionError)


def test_a_plan_path_that_is_a_directory_is_an_error(tmp_path):
    with pytest.raises(BucketPlanError, match="cannot be read"):
        BucketPlan.load(tmp_path)


# --- parse_policy --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        ("exact", BucketPolicy("exact")),
        ("pow2", BucketPolicy("pow2")),
        ("auto", BucketPolicy("auto")),
        ("multiple", BucketPolicy("multiple")),
        ({"pow2": {"min": 32}}, BucketPolicy("pow2", min_bucket=32)),
        ({"pow2": {"min_bucket": 8}}, BucketPolicy("pow2", min_bucket=8)),
        ({"pow2": 64}, BucketPolicy("pow2", min_bucket=64)),
        ({"pow2": None}, BucketPolicy("pow2")),
        ({"policy": "pow2", "min_bucket": 32}, BucketPolicy("pow2", min_bucket=32)),
        ({"policy": "auto", "min": 4}, BucketPolicy("auto", min_bucket=4)),
        ({"multiple": 128}, BucketPolicy("multiple", multiple=128)),
        ({"multiple": {"multiple": 8}}, BucketPolicy("multiple", multiple=8)),
        ({"sizes": [64, 128, 256]}, BucketPolicy("sizes", sizes=(64, 128, 256))),
        ({"exact": {}}, BucketPolicy("exact")),
        (BucketPolicy("sizes", sizes=(3,)), BucketPolicy("sizes", sizes=(3,))),
    ],
)
def test_parse_policy_accepts_each_form(value, expected):
    assert parse_policy(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        "pow3",
        "",
        "sizes",  # no sizes given
        3,
        None,
        ["pow2"],
        {"multiple": 0},
        {"multiple": -128},
        {"multiple": 2.5},
        {"multiple": True},
        {"pow2": {"min": 0}},
        {"pow2": {"min": 16, "min_bucket": 32}},
        {"pow2": {"mni": 16}},
        {"policy": "pow2", "multiple": 64},
        {"policy": "bogus"},
        {"exact": 5},
        {"sizes": [128, 64]},
        {"sizes": [64, 64]},
        {"sizes": [0, 64]},
        {"sizes": []},
        {"sizes": "64,128"},
        {"sizes": [64, 128.0]},
        {"pow2": 16, "multiple": 128},
    ],
)
def test_parse_policy_refuses_bad_values_naming_them(value):
    with pytest.raises(OptionError) as info:
        parse_policy(value, where="option 'shapes.bucketing'")
    message = str(info.value)
    assert "option 'shapes.bucketing'" in message and repr(value) in message
    assert "{'sizes': [64, 128, 256]}" in message  # the forms allowed
