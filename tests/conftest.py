"""Test session setup: each test is independent of the others and of the order they run in.

- Caches: every test gets private, empty cache directories (ours and torch's, which holds
  AOTAutogradCache entries that refer to ours): an entry one test wrote can never make another
  test's compile a cache hit that skips the lowering it means to check.
- Randomness: torch's global generator is seeded per test from the test's id and put back
  afterwards, so a test draws the same numbers whatever ran before it (no module-level seeding).
- Property tests: hypothesis draws the same examples on every run (a CI run is reproducible),
  different ones per test (the seed derives from each test); TPU_INDUCTOR_HYPOTHESIS_PROFILE
  =mutation draws fewer (tools/mutation sets it).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import zlib

import pytest
import torch
from hypothesis import settings

settings.register_profile("reproducible", derandomize=True, max_examples=12)
# `make mutation` runs each test once per mutant: its explicit examples and a few drawn ones.
settings.register_profile("mutation", derandomize=True, max_examples=4)
settings.load_profile(os.environ.get("TPU_INDUCTOR_HYPOTHESIS_PROFILE", "reproducible"))


_CACHE_VARIABLES = ("TPU_INDUCTOR_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


@contextlib.contextmanager
def _private_dirs(prefix: str):
    """A private, empty folder named in both cache variables for the block, put back after."""
    with tempfile.TemporaryDirectory(prefix=prefix) as path:
        os.chmod(path, 0o700)
        previous = {name: os.environ.get(name) for name in _CACHE_VARIABLES}
        os.environ.update(dict(zip(_CACHE_VARIABLES, (path, os.path.join(path, "torch")))))
        try:
            yield path
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@pytest.fixture(autouse=True, scope="session")
def _session_cache_dir():
    """The caches of session- and module-scoped fixtures: never the user's own."""
    with _private_dirs("tpu-inductor-test-session-") as path:
        yield path


@pytest.fixture(autouse=True)
def _private_cache_dir(_session_cache_dir):
    """Each test's own caches: another test's entries can never make its compile a hit."""
    with _private_dirs("tpu-inductor-test-") as path:
        yield path


@pytest.fixture(autouse=True)
def _seeded_torch(request):
    """torch's global generator seeded from the test's id, its earlier state restored after."""
    state = torch.random.get_rng_state()
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield
    torch.random.set_rng_state(state)


@pytest.fixture
def compiled_graphs(monkeypatch) -> list:
    """Every compiled_graph.CompiledGraph made during the test, in order."""
    from tpu_inductor.runtime import compiled_graph

    made = []
    init = compiled_graph.CompiledGraph.__init__

    def record(graph, *args, **kwargs):
        init(graph, *args, **kwargs)
        made.append(graph)

    monkeypatch.setattr(compiled_graph.CompiledGraph, "__init__", record)
    return made


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters reset before and after the test: it compiles its own
    graphs, never reaching a recompile limit that the tests before it filled. A module opts in
    with `pytestmark = pytest.mark.usefixtures("fresh_dynamo")`."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
