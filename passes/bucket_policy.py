"""bucket_policy: which size a symbolic dim is compiled at (shape bucketing); the pure policy.

A graph with a symbolic size (a sequence length, a batch) compiles once per *bucket*, not per
size, its inputs padded up to the bucket (elsewhere). Policies (`BucketPolicy.kind`):

- "exact": every size its own bucket: a compile per size, no padding.
- "pow2": the next power of two >= `min_bucket` (16: 2..16 share 16, then 32, 64, ...): about
  log2(largest) compiles, padding up to 2x.
- "multiple": the next multiple of `multiple` (128: 128, 256, ...): padding under `multiple`.
- "sizes": the smallest explicit size holding the size; one past the largest compiles exactly.
- "auto": boundaries chosen from the sizes observed (`choose_boundaries` per symbol,
  `choose_joint` jointly for the symbols of one graph: batch x length x ...; kept in a
  `BucketPlan` file), then as "sizes"; until a plan exists, as "pow2".

Always: sizes 0 and 1 are never padded (torch specializes them); a bucket never passes a `bound`
the graph implies (a position table's length, mark_dynamic(max=)), but is clamped to it, and a
size past it compiles exactly. `bucket` is >= the size, monotone in it and idempotent.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np

from ..exc import OptionError
from ..files import write_atomic

KINDS = ("exact", "pow2", "multiple", "sizes", "auto")
# One more bucket (one more compile) priced in padded elements of the dim. A TPU compile takes
# seconds to minutes, a padded position a sliver of a step: at 4096 a new bucket pays once it
# saves 4096 padded positions over the calls seen (32 calls padded by 128). 0: one per size.
DEFAULT_COMPILE_COST = 4096.0
# How many combinations of per-symbol candidates `choose_joint` scores at most (8 per symbol
# up to 4 symbols; fewer beyond).
JOINT_FAMILY = 4096

PLAN_FORMAT, PLAN_VERSION = "tpu_inductor.bucket_plan", 2  # 2: joint plans (of 2+ symbols)
_FORMS = (
    "'exact', 'pow2', 'auto', 'multiple', {'pow2': {'min': 32}}, "
    "{'policy': 'pow2', 'min_bucket': 32}, {'multiple': 128}, {'sizes': [64, 128, 256]}"
)
# The one field a kind's parameters may set (also by its value alone: {"multiple": 128}).
_FIELD = {"pow2": "min_bucket", "auto": "min_bucket", "multiple": "multiple", "sizes": "sizes"}


class BucketPlanError(OptionError):
    """A bucket plan file that cannot be used: unreadable, not JSON, or not our format."""


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _check_size(name: str, value: Any) -> None:
    if not _is_int(value) or value < 0:
        raise ValueError(f"bucketing: {name} must be a non-negative int, not {value!r}")


def _problem(kind: Any, min_bucket: Any, multiple: Any, sizes: Any) -> str | None:
    if not isinstance(kind, str) or kind not in KINDS:
        return f"unknown kind {kind!r} (one of {', '.join(KINDS)})"
    for name, v in (("min_bucket", min_bucket), ("multiple", multiple)):
        if not _is_int(v) or v < 1:
            return f"{name} must be a positive int, not {v!r}"
    if not isinstance(sizes, (tuple, list)) or not all(_is_int(s) and s >= 1 for s in sizes):
        return f"sizes must be a list of positive ints, not {sizes!r}"
    if any(a >= b for a, b in zip(sizes, sizes[1:])) or (kind == "sizes" and not sizes):
        return f"sizes must be one or more strictly ascending ints, not {list(sizes)!r}"
    return None


@dataclass(frozen=True)
class BucketPolicy:
    """A bucketing policy (see the module docstring); invalid fields raise OptionError."""

    kind: str
    min_bucket: int = 16
    multiple: int = 128
    sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        problem = _problem(self.kind, self.min_bucket, self.multiple, self.sizes)
        if problem:
            raise OptionError(f"BucketPolicy: {problem}; allowed forms: {_FORMS}")
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))

    def bucket(self, size: int, bound: int | None = None) -> int:
        """The smallest bucket >= size, never above `bound`: a bucket past it is `bound` when
        size <= bound, else size itself. Sizes 0 and 1 are returned as they are."""
        _check_size("size", size), _check_size("bound", 0 if bound is None else bound)
        kind = ("sizes" if self.sizes else "pow2") if self.kind == "auto" else self.kind
        if size <= 1 or kind == "exact":
            return int(size)
        if kind == "pow2":
            b = 1 << (max(self.min_bucket, size) - 1).bit_length()
        elif kind == "multiple":
            b = -(-size // self.multiple) * self.multiple
        else:
            i = bisect_left(self.sizes, size)
            b = self.sizes[i] if i < len(self.sizes) else size
        return int(b if bound is None or b <= bound else bound if size <= bound else size)

    def buckets_up_to(self, largest: int, bound: int | None = None) -> list[int]:
        """Every distinct bucket serving sizes 2..largest (for precompiling), ascending."""
        out, size = [], 2
        while size <= largest:  # every size in size..b has bucket b (monotone, idempotent)
            out.append(self.bucket(size, bound))
            size = out[-1] + 1
        return out


def _check_search(k: Any, cost: Any) -> None:
    number = isinstance(cost, (int, float)) and not isinstance(cost, bool) and 0 <= cost < 1e300
    if not number or not _is_int(k) or k < 1:
        raise OptionError(f"bucketing: want max_buckets >= 1, compile_cost >= 0, not {k}, {cost}")


def _observed(histogram: Mapping[int, int], bound: int | None) -> tuple[list[int], list[int]]:
    """The distinct sizes buckets serve (>= 2, <= bound, counted), ascending; their counts."""
    for size, count in histogram.items():
        _check_size("a histogram's size", size), _check_size(f"size {size}'s count", count)
    top = float("inf") if bound is None else bound
    seen = sorted(int(s) for s, c in histogram.items() if c and 2 <= s <= top)
    return seen, [int(histogram[s]) for s in seen]


def _optimal_per_k(sizes: list[int], counts: list[int], kmax: int) -> list[tuple[int, tuple]]:
    """For k = 1..min(kmax, n): the least padded work with k boundaries and the smallest such
    boundaries. f[k, i]: the least work serving sizes[i:] in k buckets (`inf`: none); a bucket
    of sizes[i..j] costs x[j]*(C[j+1]-C[i]) - (S[j+1]-S[i]) (prefix sums of counts, of
    count*size); the first optimal j is the smallest boundary. O(n^2 k), exact integers."""
    n, kmax = len(sizes), min(kmax, len(sizes))
    inf = 2 * max(sizes, default=0) * sum(counts) + 2  # past any work (which is < inf / 2)
    dtype = np.int64 if inf < 2**62 else object
    x, c = np.array(sizes, dtype=dtype), np.array(counts, dtype=dtype)
    cum_c = np.concatenate([np.zeros(1, dtype), np.cumsum(c)]).astype(dtype)
    cum_s = np.concatenate([np.zeros(1, dtype), np.cumsum(c * x)]).astype(dtype)
    f, choice = np.full((kmax + 1, n + 1), inf, dtype), np.zeros((kmax + 1, n), np.int64)
    f[0, n] = 0
    for k, i in ((k, i) for k in range(1, kmax + 1) for i in range(n)):
        js = np.arange(i, n)
        total = x[js] * (cum_c[js + 1] - cum_c[i]) - (cum_s[js + 1] - cum_s[i]) + f[k - 1, js + 1]
        choice[k, i] = i + int(np.argmin(total))  # the first minimum: the smallest boundary
        f[k, i] = min(total[choice[k, i] - i], inf)
    out = []
    for k in range(1, kmax + 1):
        bounds = [-1]  # sizes[bounds[-1] + 1:] are left to serve
        for kk in range(k, 0, -1):
            bounds.append(int(choice[kk, bounds[-1] + 1]))
        out.append((int(f[k, 0]), tuple(sizes[j] for j in bounds[1:])))
    return out


def choose_boundaries(
    histogram: Mapping, *, max_buckets: int = 8, compile_cost: float, bound: int | None = None
) -> tuple[int, ...]:
    """The `auto` policy: from `histogram` (size -> count) at most `max_buckets` ascending
    boundaries, all observed sizes, the last the largest <= bound, minimising count*(bucket -
    size) summed plus compile_cost per bucket. Exact (a dynamic program over the distinct sizes,
    O(n^2 k)); ties go to fewer buckets, then smaller boundaries. Sizes 0 and 1 (never padded)
    and sizes past `bound` (compiled exactly) take no part; () when no size is left."""
    _check_search(max_buckets, compile_cost)
    options = _optimal_per_k(*_observed(histogram, bound), max_buckets)
    # min keeps the first of equal totals: the fewest buckets (and each k's smallest boundaries)
    return min(options, key=lambda o: o[0] + compile_cost * len(o[1]), default=(0, ()))[1]


def choose_joint(
    histogram: Mapping[tuple[int, ...], int], *, max_buckets: int = 8, compile_cost: float
) -> tuple[tuple[int, ...], ...]:
    """Boundaries for two or more symbols of one graph (batch x length x ...; histogram: their
    sizes -> count): at most `max_buckets` bucket tuples in use, least count*(the product of the
    buckets - the product of the sizes) + compile_cost per tuple. Optimal over a family, not all
    boundary sets: each symbol's optimal k-bucket boundaries (k = 1..max_buckets, fewer for
    many symbols: at most JOINT_FAMILY combinations in all) for its histogram weighted by the
    others' sizes, every combination scored at its joint cost. The bound holds unless sizes 0
    and 1 (never padded) force more tuples (then the fewest win). Ties: fewer tuples, then
    smaller boundaries. One tuple of boundaries per symbol, in the histogram's order."""
    _check_search(max_buckets, compile_cost)
    width = {len(sizes) if isinstance(sizes, tuple) else 0 for sizes in histogram} or {2}
    if len(width) > 1 or min(width) < 2:
        raise ValueError(f"choose_joint: want sizes of two or more symbols, not {width}")
    n = width.pop()
    items, marginals = [], [{} for _ in range(n)]
    for sizes, count in histogram.items():
        for size in sizes:
            _check_size(f"a size of {sizes}", size)
        _check_size(f"{sizes}'s count", count)
        for i, m in enumerate(marginals):
            weight = math.prod(max(o, 1) for j, o in enumerate(sizes) if j != i)
            m[sizes[i]] = m.get(sizes[i], 0) + count * weight
        items += [(tuple(int(v) for v in sizes), int(count))] if count else []
    per_symbol = max(k for k in range(1, max_buckets + 1) if k**n <= max(JOINT_FAMILY, 1))
    cands = [_optimal_per_k(*_observed(m, None), per_symbol) or [(0, ())] for m in marginals]
    largest = math.prod(max((s[i] for s, _ in items), default=1) for i in range(n))
    total = sum(c for _, c in items)
    dtype = np.int64 if 2 * max(largest, 16**n) * (total + 1) < 2**62 else object
    counts = np.array([c for _, c in items], dtype)
    real = int((counts * np.prod([[s[i] for s, _ in items] for i in range(n)], 0, dtype)).sum())
    # per symbol, per candidate: each item's bucket
    tables = [
        [[BucketPolicy("auto", sizes=b).bucket(s[i]) for s, _ in items] for _, b in cand]
        for i, cand in enumerate(cands)
    ]

    def score(choice: tuple[int, ...]) -> tuple:  # the least is best
        buckets = [tables[i][j] for i, j in enumerate(choice)]
        used = len(set(zip(*buckets)))
        work = int((counts * np.prod(np.array(buckets, dtype), 0, dtype)).sum()) - real
        over = used > max_buckets
        chosen = tuple(cands[i][j][1] for i, j in enumerate(choice))
        return over, used * over, work + compile_cost * used, used, chosen

    return min(score(c) for c in product(*(range(len(c)) for c in cands)))[4]


JointKey = tuple[str, ...]  # two or more symbol keys, sorted: what a joint plan buckets together


@dataclass
class BucketPlan:
    """Per symbol key (a text such as "L['input_ids'].size()[1]"), its chosen boundaries and
    the histogram (size -> count) they were chosen from; per set of keys one graph's sizes come
    in (batch x length, or more), their boundaries chosen jointly (`choose_joint`) and their
    histogram ((size, ...) -> count), keys sorted. Saved as JSON; joint boundaries win over
    each key's."""

    boundaries: dict[str, tuple[int, ...]] = field(default_factory=dict)
    histogram: dict[str, dict[int, int]] = field(default_factory=dict)
    joint: dict[JointKey, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    joint_histogram: dict[JointKey, dict[tuple[int, ...], int]] = field(default_factory=dict)

    def observe(self, key: str, size: int) -> None:
        """Count one call at `size` for symbol `key`."""
        _check_size("size", size)
        sizes = self.histogram.setdefault(key, {})
        sizes[int(size)] = sizes.get(int(size), 0) + 1

    def observe_call(self, keys: tuple[str, ...], sizes: tuple[int, ...]) -> None:
        """Count one call of a graph whose symbols `keys` are at `sizes`: per key, and for a
        graph of two or more symbols, jointly."""
        for key, size in zip(keys, sizes):
            self.observe(key, size)
        if len(keys) >= 2:
            joint, together = _sorted_keys(keys, sizes)
            counts = self.joint_histogram.setdefault(joint, {})
            counts[together] = counts.get(together, 0) + 1

    def policy_for(self, key: str, base: BucketPolicy) -> BucketPolicy:
        """An "auto" policy bucketing as "sizes" at the key's boundaries, else `base`."""
        sizes = self.boundaries.get(key)
        return replace(base, kind="auto", sizes=sizes) if sizes else base

    def policies_for(self, keys: tuple[str, ...], base: BucketPolicy) -> tuple[BucketPolicy, ...]:
        """The policy of each of a graph's symbol `keys`: their joint boundaries where the plan
        has them, else each key's (`policy_for`)."""
        joint = tuple(sorted(keys))
        if joint in self.joint:
            chosen = dict(zip(joint, self.joint[joint]))
            return tuple(replace(base, kind="auto", sizes=chosen[k]) for k in keys)
        return tuple(self.policy_for(key, base) for key in keys)

    def replan(self, *, max_buckets: int | None = None, compile_cost: float) -> None:
        """Every histogram's boundaries again: each key's by `choose_boundaries`, each joint
        histogram's by `choose_joint` (none: the entry is dropped). `max_buckets` (per key;
        jointly: bucket tuples in use) defaults to as many as pow2 would use for the sizes seen,
        so never more compiles than pow2."""
        pow2 = BucketPolicy("pow2", min_bucket=1)
        for key, sizes in self.histogram.items():
            budget = max_buckets or max(1, len({pow2.bucket(n) for n in sizes}))
            self.boundaries[key] = choose_boundaries(
                sizes, max_buckets=budget, compile_cost=compile_cost
            )
        for keys, sizes in self.joint_histogram.items():
            budget = max_buckets or max(1, len({tuple(map(pow2.bucket, bl)) for bl in sizes}))
            self.joint[keys] = choose_joint(sizes, max_buckets=budget, compile_cost=compile_cost)
        self.boundaries = {k: b for k, b in self.boundaries.items() if b}
        self.joint = {k: b for k, b in self.joint.items() if any(b)}

    def _document(self) -> dict[str, Any]:
        """The JSON form; entries with neither boundaries nor a histogram are left out."""
        symbols = {}
        for key in sorted(set(self.boundaries) | set(self.histogram)):
            bounds, hist = self.boundaries.get(key, ()), self.histogram.get(key, {})
            if bounds or hist:
                pairs = [[int(s), int(c)] for s, c in sorted(hist.items())]
                symbols[key] = {"boundaries": [int(s) for s in bounds], "histogram": pairs}
        joint = []
        for keys in sorted(set(self.joint) | set(self.joint_histogram)):
            bounds, hist = (
                self.joint.get(keys, ((),) * len(keys)),
                self.joint_histogram.get(keys, {}),
            )
            if any(bounds) or hist:
                counts = [[*map(int, sizes), int(c)] for sizes, c in sorted(hist.items())]
                chosen = [[int(s) for s in b] for b in bounds]
                joint.append({"symbols": list(keys), "boundaries": chosen, "histogram": counts})
        doc = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "symbols": symbols}
        return {**doc, "joint": joint}

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON, atomically (a reader sees the old file or the new)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(Path(path), (json.dumps(self._document(), indent=1) + "\n").encode())

    @classmethod
    def load(cls, path: str | Path) -> BucketPlan:
        """The plan saved at `path`; a missing file is an empty plan, one that is not a plan as
        `save` writes it raises BucketPlanError. Empty boundaries and histograms are not kept."""

        def fail(what: str) -> BucketPlanError:
            return BucketPlanError(f"bucket plan {path} {what}: delete it to start anew, or fix it")

        try:
            doc = json.loads(Path(path).read_bytes())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as e:
            raise fail(f"cannot be read as JSON ({e})") from None
        head = (doc.get("format"), doc.get("version")) if isinstance(doc, dict) else (None, None)
        if head != (PLAN_FORMAT, PLAN_VERSION) or type(head[1]) is not int:
            raise fail(f"has (format, version) {head!r}, not {(PLAN_FORMAT, PLAN_VERSION)!r}")
        try:  # whatever is wrong raises here or makes the plan's document differ from the file's
            plan = cls._of_document(doc)
            problem = "" if plan._document() == doc else "extra, empty or unsorted entries"
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            problem = f"{type(e).__name__}: {e}"
        if problem:
            raise fail(f"is not the JSON `BucketPlan.save` writes ({problem})")
        return plan

    @classmethod
    def _of_document(cls, doc: dict) -> BucketPlan:
        """The plan of a JSON document (raising on what no plan could be made of)."""
        items = doc["symbols"].items()
        plan = cls({k: tuple(v["boundaries"]) for k, v in items if v["boundaries"]})
        plan.histogram = {k: dict(v["histogram"]) for k, v in items if v["histogram"]}
        for entry in doc["joint"]:
            keys, n = tuple(entry["symbols"]), len(entry["symbols"])
            if n < 2 or list(keys) != sorted(set(keys)) or len(entry["boundaries"]) != n:
                raise ValueError(
                    f"joint symbols {list(keys)}: want 2 or more, sorted, as many boundaries"
                )
            bounds = tuple(tuple(b) for b in entry["boundaries"])
            plan.joint.update({keys: bounds} if any(bounds) else {})
            if any(len(row) != n + 1 for row in entry["histogram"]):
                raise ValueError(f"joint histogram rows of {list(keys)}: want {n} sizes, a count")
            counts = {tuple(row[:-1]): row[-1] for row in entry["histogram"]}
            plan.joint_histogram.update({keys: counts} if counts else {})
        chosen = [*plan.boundaries.values(), *(b for bs in plan.joint.values() for b in bs if b)]
        _ = [BucketPolicy("sizes", sizes=b) for b in chosen]
        _ = [_observed(counts, None) for counts in plan.histogram.values()]
        for counts in plan.joint_histogram.values():
            for sizes, c in counts.items():
                _ = [_check_size(f"a size of {sizes}", v) for v in sizes]
                _check_size(f"{sizes}'s count", c)
        return plan


def _sorted_keys(keys: tuple, sizes: tuple) -> tuple[JointKey, tuple[int, ...]]:
    """Keys in sorted order, and their sizes in the same order."""
    order = sorted(range(len(keys)), key=lambda i: keys[i])
    return tuple(keys[i] for i in order), tuple(int(sizes[i]) for i in order)


def parse_policy(value: Any, where: str = "option 'bucketing'") -> BucketPolicy:
    """The policy the user's option value names: a kind's name, {kind: params or its one value},
    {"policy": kind, **params}, or a BucketPolicy. Anything else raises OptionError naming
    `where`, the value and the forms allowed."""
    if isinstance(value, BucketPolicy):
        return value

    def bad(reason: str) -> OptionError:
        return OptionError(f"{where}: {value!r}: {reason}. Allowed: {_FORMS}")

    if isinstance(value, str):
        kind, params = value, {}
    elif isinstance(value, Mapping) and "policy" in value:
        kind, params = value["policy"], {k: v for k, v in value.items() if k != "policy"}
    elif isinstance(value, Mapping) and len(value) == 1:
        ((kind, params),) = value.items()
        if params is not None and not isinstance(params, Mapping):
            params = {_FIELD.get(kind, "a value"): params}
    else:
        raise bad("not a policy name, a one-key mapping or a mapping with 'policy'")
    if not isinstance(kind, str) or kind not in KINDS:
        raise bad(f"unknown kind {kind!r}")
    fields = {{"min": "min_bucket"}.get(key, key): v for key, v in (params or {}).items()}
    if len(fields) < len(params or {}) or set(fields) - {_FIELD.get(kind)}:
        raise bad(f"{kind!r} takes {repr(_FIELD[kind]) if kind in _FIELD else 'no parameters'}")
    problem = _problem(kind, **{"min_bucket": 16, "multiple": 128, "sizes": (), **fields})
    if problem:
        raise bad(problem)
    return BucketPolicy(kind, **fields)
