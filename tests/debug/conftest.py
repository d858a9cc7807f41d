"""Fixtures of the debug tests."""

from __future__ import annotations

import pytest

from tests.debug.dump_run import dump_run


@pytest.fixture(scope="package")
def run_dump(tmp_path_factory):
    """(dump folder, its compiles, the recompile log lines) of `dump_run`, made once."""
    return dump_run(tmp_path_factory)
