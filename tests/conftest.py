"""Test session setup: a private, empty compile-cache directory for the whole run."""

from __future__ import annotations

import os
import tempfile

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir():
    """Keep the suite out of the user's cache (and the user's cache out of the suite)."""
    with tempfile.TemporaryDirectory(prefix="tpu-inductor-test-cache-") as path:
        os.chmod(path, 0o700)
        previous = os.environ.get("TPU_INDUCTOR_CACHE_DIR")
        os.environ["TPU_INDUCTOR_CACHE_DIR"] = path
        yield path
        if previous is None:
            os.environ.pop("TPU_INDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TPU_INDUCTOR_CACHE_DIR"] = previous
