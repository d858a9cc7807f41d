"""What every padding rule of passes/bucket_rules.py states its proof with: `Refused`, raised
for what a rule cannot prove exact (with the reason), and `size_expr`, a size as a sympy
expression."""

from __future__ import annotations

import sympy
import torch


class Refused(Exception):
    """The graph cannot be proven exact under padding: the reason."""


def size_expr(d) -> sympy.Expr:
    """A size (an int or a SymInt) as a sympy expression."""
    return d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(int(d))
