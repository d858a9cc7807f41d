"""What happened in each compile: stage timings, the cache decision, the input signature.

`compile_fx` opens one `CompileRecord` per compiled graph specialization and times each stage
with `record.stage(name)`; dumps, recompile explanations and the benchmark's cold-start
breakdown read these records. This module imports none of the other rooms.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

_ids = itertools.count()


@dataclasses.dataclass
class CompileRecord:
    """One compiled specialization of one graph."""

    graph: str  # a short name of the graph, e.g. "forward_3"
    inputs: tuple  # the input signature it was compiled for
    timings: dict[str, float] = dataclasses.field(default_factory=dict)  # stage → seconds
    cache: dict[str, Any] = dataclasses.field(default_factory=dict)  # decision, key digest, ...
    id: int = dataclasses.field(default_factory=lambda: next(_ids))

    @contextlib.contextmanager
    def stage(self, name: str):
        """Time a stage; repeated stages add up."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start


# Every record of this process, oldest first (tests and the benchmark read them).
records: list[CompileRecord] = []


def new_record(graph: str, inputs: tuple) -> CompileRecord:
    record = CompileRecord(graph, inputs)
    records.append(record)
    return record
