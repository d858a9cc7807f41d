"""The padding rules of passes/bucket_shapes.py: per ATen op, the layout of its result (which
dims carry padding, as row-major factors) from its inputs', masking the inputs the op reads
across with the op's identity. A rule raises `Refused` for what it cannot prove exact.

This module is the table; the rules are written by op family in bucket_rules_dims.py,
bucket_rules_slices.py, bucket_rules_index.py, bucket_rules_nn.py and bucket_rules_flex.py.
"""

from __future__ import annotations

import torch

from . import (
    bucket_rules_dims,
    bucket_rules_flex,
    bucket_rules_index,
    bucket_rules_nn,
    bucket_rules_slices,
)
from .bucket_proof import Refused, size_expr
from .bucket_rules_dims import VIEWS, _pointwise
from .bucket_rules_nn import attention

__all__ = ["RULES", "VIEWS", "Refused", "attention", "rule_by_tag", "size_expr"]

RULES = {
    **bucket_rules_dims.RULES,
    **bucket_rules_slices.RULES,
    **bucket_rules_index.RULES,
    **bucket_rules_nn.RULES,
    **bucket_rules_flex.RULES,
}


def rule_by_tag(target):
    """The pointwise rule for an op torch tags pointwise (not in RULES), else None."""
    return _pointwise if torch.Tag.pointwise in getattr(target, "tags", ()) else None
