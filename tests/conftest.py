"""Test session setup: private, empty cache directories (ours and torch's) for the whole run,
and property tests that draw the same examples on every run (a CI run is reproducible)."""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import settings

settings.register_profile("reproducible", derandomize=True)
settings.load_profile("reproducible")


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir():
    """Keep the suite out of the user's cache (and the user's cache out of the suite)."""
    with tempfile.TemporaryDirectory(prefix="tpu-inductor-test-cache-") as path:
        os.chmod(path, 0o700)
        settings = {  # torch's holds AOTAutogradCache entries, which refer to ours
            "TPU_INDUCTOR_CACHE_DIR": path,
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(path, "torch"),
        }
        previous = {name: os.environ.get(name) for name in settings}
        os.environ.update(settings)
        yield path
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
