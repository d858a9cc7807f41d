"""Surviving mutants judged equivalent (no input can tell them from the original), with why.

Key: (rule file, Cosmic Ray operator, the changed line before, after), as the report prints it
for each survivor: a line that moves keeps its judgement, a line that changes is judged again.
"""

from __future__ import annotations

EQUIVALENT: dict[tuple[str, str, str, str], str] = {}
