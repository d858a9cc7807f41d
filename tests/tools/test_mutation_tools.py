"""The mutation harness (tools/mutation) on its own: what it mutates and how it picks tests.

The mutation run itself is `make mutation` (minutes, not part of `make test`); these check the
parts that would silently weaken it: a named mutant that no longer applies, a sample that
changes between runs, a mutant mapped to the wrong tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.mutation import coverage_map, plan, run
from tools.mutation.workspace import Workspace

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("named", plan.NAMED, ids=lambda m: m.name)
def test_named_mutants_apply_to_their_rule_files(named):
    source = (ROOT / named.path).read_text()
    assert named.path in plan.TARGETS
    assert source.count(named.original) == 1, "the rule changed: rewrite the named mutant"
    assert named.mutated != named.original
    compile(source.replace(named.original, named.mutated), named.path, "exec")


def test_every_target_has_tests():
    for path, tests in plan.TARGETS.items():
        assert (ROOT / path).is_file() and tests
        assert all((ROOT / t).is_file() for t in tests), path


def test_the_sample_is_deterministic_and_draws_distinct_sites(tmp_path):
    items = run.mutants_of(ROOT / "lowering/ops/reduction.py", tmp_path / "session.sqlite")
    first = run.sample(items, 12, 0, "lowering/ops/reduction.py")
    again = run.sample(items, 12, 0, "lowering/ops/reduction.py")
    other = run.sample(items, 12, 1, "lowering/ops/reduction.py")
    key = [(i.mutations[0].start_pos, i.mutations[0].operator_name) for i in first]
    assert key == [(i.mutations[0].start_pos, i.mutations[0].operator_name) for i in again]
    assert key != [(i.mutations[0].start_pos, i.mutations[0].operator_name) for i in other]
    assert len({i.mutations[0].start_pos for i in first}) == 12


_SOURCE = """import functools
TABLE = {1: 2}


@functools.cache
def outer(x, scale=2.0):
    def inner(y):
        return y + 1

    return inner(x) * scale
"""


def test_a_mutant_runs_the_tests_of_its_innermost_function():
    assert coverage_map.function_region(_SOURCE, 2) is None  # module level: every test
    assert coverage_map.function_region(_SOURCE, 5) == range(7, 11)  # the decorator: the body
    assert coverage_map.function_region(_SOURCE, 6) == range(7, 11)  # a default argument
    assert coverage_map.function_region(_SOURCE, 7) == range(8, 9)  # inner's def line
    assert coverage_map.function_region(_SOURCE, 8) == range(8, 9)
    lines = {7: frozenset({"t::a"}), 8: frozenset({"t::b"}), 10: frozenset({"t::c"})}
    cmap = coverage_map.CoverageMap(lines, {"t::a": 3.0, "t::b": 0.5}, 1.0)
    assert cmap.tests_for(range(7, 9)) == {"t::a", "t::b"}
    assert cmap.quickest_first({"t::a", "t::b", "t::c"}) == ["t::b", "t::a", "t::c"]


def test_changed_lines_and_workspace_paths():
    mutated = _SOURCE.replace("y + 1", "y - 1")
    assert run._changed(_SOURCE, mutated) == ("return y + 1", "return y - 1")
    ws = Workspace(Path("/w"))
    assert ws.path_of("lowering/ops/losses.py") == Path("/w/tpu_inductor/lowering/ops/losses.py")
    assert ws.path_of("tests/lowering/test_nn_ops_losses.py") == Path(
        "/w/tests/lowering/test_nn_ops_losses.py"
    )
