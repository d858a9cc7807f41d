"""Surviving mutants judged equivalent (no input can tell them from the original), with why.

Key: (rule file, Cosmic Ray operator, the changed line before, after), as the report prints it
for each survivor: a line that moves keeps its judgement, a line that changes is judged again.
"""

from __future__ import annotations

EQUIVALENT: dict[tuple[str, str, str, str], str] = {
    (
        "lowering/ops/pointwise.py",
        "core/NumberReplacer",
        "steps = int(np.max(np.asarray(b), initial=0)).bit_length()",
        "steps = int(np.max(np.asarray(b), initial= 1)).bit_length()",
    ): "one more squaring step where every exponent is 0: its bit is 0, the result unchanged",
}
