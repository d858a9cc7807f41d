"""The dumped run several debug tests read (the `run_dump` fixture in conftest.py): a model
train-stepped through torch.compile at three batch sizes, every compile dumped."""

from __future__ import annotations

import logging

import torch

from tests.helpers import assert_same, forget_compiles
from tpu_inductor.debug import records, report

SIZES = (2, 5, 7)  # static, then automatic dynamic (a symbolic graph), then a specialization


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x):
        hidden = self.proj(x)  # SOURCE-LINE-MARK
        return torch.relu(hidden) * 2


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def folders(compiles, kind):
    """The compiles (compile.json contents) of graphs named `kind`_<n>, e.g. "forward"."""
    return [c for c in compiles if c["graph"].startswith(kind)]


def dump_run(tmp_path_factory):
    """Train-step a model through torch.compile at three batch sizes, dumping every compile."""
    dump = tmp_path_factory.mktemp("dump")
    # The run is this process's first: no executable another test left in the memory cache may
    # turn its compiles into hits (cache=False is the disk's), and no earlier test's compile
    # record of the same graph may stand as the "earlier compile" a recompile is explained by.
    forget_compiles()
    records.records.clear()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block()
    compiled = torch.compile(
        model,
        backend="tpu_inductor",
        # the per-size records and explanations of the exact policy are what is checked
        options={"dump_dir": str(dump), "cache": False, "shapes": {"policy": "exact"}},
    )
    handler, logger = Capture(), logging.getLogger("tpu_inductor.debug.recompiles")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for n in SIZES:
            x = torch.randn(n, 4)
            actual = compiled(x)
            actual_grads = torch.autograd.grad(actual.sum(), list(model.parameters()))
            expected = model(x)
            expected_grads = torch.autograd.grad(expected.sum(), list(model.parameters()))
            assert_same(actual, expected)
            assert_same(actual_grads, expected_grads)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return dump, report.load_run(dump), handler.messages
