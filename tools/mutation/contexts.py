"""A pytest plugin for the coverage run: each test's lines are recorded under its node id.

(coverage's own `dynamic_context = test_function` names hypothesis's inner `test_function`
for every property test.) Copied into the workspace and loaded with `-p`.
"""

from __future__ import annotations

import coverage


def pytest_runtest_setup(item):
    current = coverage.Coverage.current()
    if current is not None:
        current.switch_context(item.nodeid)


def pytest_runtest_teardown(item):
    current = coverage.Coverage.current()
    if current is not None:
        current.switch_context("")
