"""Sample a rule file's mutants, run each against the tests that execute it, classify them.

Outcomes: killed (a test failed, or the run timed out), survived, equivalent (a survivor in
equivalent.py, with its reason), no tests (no test executes the changed function), not run
(the file's time box ran out first), error (the mutation could not be applied).
"""

from __future__ import annotations

import dataclasses
import difflib
import random
import re
import time
from pathlib import Path

from cosmic_ray.commands.init import init
from cosmic_ray.mutating import mutate_and_test, mutate_code
from cosmic_ray.plugins import get_operator
from cosmic_ray.testing import run_tests
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome

from . import coverage_map
from .equivalent import EQUIVALENT
from .plan import NAMED, TARGETS, Named
from .workspace import Workspace


@dataclasses.dataclass
class Mutant:
    path: str  # the repository's path of the rule file
    operator: str  # Cosmic Ray's operator, or the named mutant's name
    line: int
    before: str  # the changed line(s), stripped
    after: str
    outcome: str = "not run"
    detail: str = ""  # the killing test, the reason it is equivalent, or an error
    seconds: float = 0.0

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.path, self.operator, self.before, self.after)


@dataclasses.dataclass
class FileResult:
    path: str
    sites: int  # distinct places Cosmic Ray can mutate
    mutants: int  # all its mutants
    sampled: list[Mutant]
    named: list[Mutant]
    baseline_s: float


def mutants_of(module: Path, db_path: Path) -> list:
    """Every mutant Cosmic Ray's operators make of `module` (its work items, one mutation
    each), recorded in a new session database at `db_path`."""
    with use_db(str(db_path), WorkDB.Mode.create) as db:
        init([module], db, {})
        return list(db.pending_work_items)


def sample(items, size: int, seed: int, path: str) -> list:
    """`size` distinct mutation sites (positions), each with one of its mutants; deterministic
    for a seed. Sites, not mutants, are drawn: a `+` has ten replacements, a `True` one."""
    sites: dict[tuple, list] = {}
    for item in items:
        spec = item.mutations[0]
        sites.setdefault((spec.start_pos, spec.end_pos), []).append(item)
    rng = random.Random(f"{seed}:{path}")
    chosen = rng.sample(sorted(sites), min(size, len(sites)))
    return [rng.choice(sorted(sites[s], key=_order)) for s in sorted(chosen)]


def _order(item):
    spec = item.mutations[0]
    return spec.operator_name, spec.occurrence


def run_file(ws: Workspace, path: str, size: int, seed: int, time_box: float) -> FileResult:
    """Mutation-test one rule file of TARGETS: its named mutants, then a time-boxed sample."""
    tests = TARGETS[path]  # relative to the workspace, the current directory
    module = ws.path_of(path)
    source = module.read_text()
    cmap = coverage_map.build(ws, path, tests)
    timeout = 2 * cmap.seconds + 60
    items = mutants_of(module.relative_to(ws.root), ws.root / f"{module.stem}.sqlite")
    named = [_run_named(ws, m, source, cmap, tests, timeout) for m in NAMED if m.path == path]
    sampled, deadline = [], time.monotonic() + time_box
    for item in sample(items, size, seed, path):
        spec = item.mutations[0]
        operator = spec.operator_name
        mutated = mutate_code(source, get_operator(operator)(**spec.operator_args), spec.occurrence)
        mutant = Mutant(path, operator, spec.start_pos[0], *_changed(source, mutated))
        sampled.append(mutant)
        if time.monotonic() > deadline:
            continue
        selected = _selected(source, mutant.line, cmap, tests)
        if not selected:
            mutant.outcome = "no tests"
            continue
        start = time.monotonic()
        command = ws.pytest_command(cmap.quickest_first(selected))
        result = mutate_and_test(item.mutations, command, timeout)
        mutant.seconds = time.monotonic() - start
        if result.worker_outcome != WorkerOutcome.NORMAL:
            mutant.outcome, mutant.detail = "error", (result.output or "")[-500:]
        else:
            _classify(mutant, result.test_outcome, result.output)
    sites = len({(i.mutations[0].start_pos, i.mutations[0].end_pos) for i in items})
    return FileResult(path, sites, len(items), sampled, named, cmap.seconds)


def _run_named(ws, named: Named, source, cmap, tests, timeout) -> Mutant:
    """Apply a named mutant as a text replacement, run the tests that execute it, restore."""
    module = ws.path_of(named.path)
    if source.count(named.original) != 1:
        return Mutant(named.path, named.name, 0, named.original, named.mutated, "error",
                      "its original text is not in the file exactly once")  # fmt: skip
    line = source[: source.index(named.original)].count("\n") + 1
    mutant = Mutant(named.path, named.name, line, named.original, named.mutated)
    module.write_text(source.replace(named.original, named.mutated))
    try:
        start = time.monotonic()
        command = ws.pytest_command(cmap.quickest_first(_selected(source, line, cmap, tests)))
        outcome, output = run_tests(command, timeout)
        mutant.seconds = time.monotonic() - start
    finally:
        module.write_text(source)
    _classify(mutant, outcome, output)
    return mutant


def _selected(source: str, line: int, cmap, tests) -> set[str]:
    region = coverage_map.function_region(source, line)
    return cmap.tests_for(region) if region else set(tests)


def _changed(source: str, mutated: str | None) -> tuple[str, str]:
    """The lines a mutation changed, before and after (stripped, joined by ' / ')."""
    if mutated is None:
        return "", ""
    before, after = [], []
    matcher = difflib.SequenceMatcher(None, source.splitlines(), mutated.splitlines())
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            before += source.splitlines()[i1:i2]
            after += mutated.splitlines()[j1:j2]
    return " / ".join(s.strip() for s in before), " / ".join(s.strip() for s in after)


def _classify(mutant: Mutant, outcome, output: str) -> None:
    if outcome == TestOutcome.KILLED:
        failed = re.search(r"^(?:FAILED|ERROR) (\S+)", output or "", re.M)
        mutant.outcome = "killed"
        mutant.detail = "timeout" if output == "timeout" else failed.group(1) if failed else ""
    elif outcome == TestOutcome.SURVIVED:
        reason = EQUIVALENT.get(mutant.key)
        mutant.outcome, mutant.detail = ("equivalent", reason) if reason else ("survived", "")
    else:
        mutant.outcome, mutant.detail = "error", (output or "")[-500:]
