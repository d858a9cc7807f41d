"""Each test is independent of the others and of their order (tests/conftest.py): its caches
are its own and start empty, and torch's global generator starts from the test's own seed."""

from __future__ import annotations

import os
import zlib

import torch

from tests.helpers import compile_aten


def test_a_test_starts_with_empty_caches_of_its_own(_private_cache_dir, _session_cache_dir):
    assert os.environ["TPU_INDUCTOR_CACHE_DIR"] == _private_cache_dir != _session_cache_dir
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(_private_cache_dir)
    assert os.listdir(_private_cache_dir) == []
    x = torch.randn(3)
    compile_aten(torch.sin, (x,))(x)
    assert os.listdir(_private_cache_dir), "the compile was cached in this test's folder"


def test_torch_draws_start_from_the_tests_own_seed(request):
    assert torch.initial_seed() == zlib.crc32(request.node.nodeid.encode())
    first = torch.rand(3)
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    assert torch.equal(torch.rand(3), first)
