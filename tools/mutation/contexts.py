"""A pytest plugin for the coverage run: each test's lines are recorded under its node id, and
its duration is written to $TPU_INDUCTOR_MUTATION_DURATIONS (JSON), so that a mutant's tests run
quickest first (the first failure ends the run).

(coverage's own `dynamic_context = test_function` names hypothesis's inner `test_function`
for every property test.) Copied into the workspace and loaded with `-p`.
"""

from __future__ import annotations

import collections
import json
import os

import coverage

_durations: collections.Counter = collections.Counter()


def pytest_runtest_setup(item):
    current = coverage.Coverage.current()
    if current is not None:
        current.switch_context(item.nodeid)


def pytest_runtest_teardown(item):
    current = coverage.Coverage.current()
    if current is not None:
        current.switch_context("")


def pytest_runtest_logreport(report):
    _durations[report.nodeid] += report.duration


def pytest_sessionfinish(session):
    path = os.environ.get("TPU_INDUCTOR_MUTATION_DURATIONS")
    if path:
        with open(path, "w") as f:
            json.dump(dict(_durations), f)
