"""An OpInfo entry's name, and its outcome at one dtype (the statuses: runner.py)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Outcome:
    status: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "pass"


def entry_name(op) -> str:
    """The OpInfo entry's name as in the expected-failure table: name or name.variant."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name
