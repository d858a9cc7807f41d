"""Which OpInfo samples draw random numbers (or read uninitialized memory), decided per sample.

A sample that draws can only be compared on shapes and dtypes; the entry's other samples are
compared on values: dropout with p=0 or training=False, multi-head attention in eval mode
and feature_alpha_dropout.without_train compute the same numbers as eager.
"""

from __future__ import annotations

# Entries every sample of which draws, or returns uninitialized memory.
ALWAYS = frozenset(
    {
        "bernoulli",
        "empty",
        "empty_like",
        "empty_strided",
        "empty_permuted",
        "new_empty",
        "new_empty_strided",
        "rand_like",
        "randint",
        "randint_like",
        "randn",
        "randn_like",
        "normal",
        "normal.number_mean",
        "normal.in_place",
        "uniform",
        "multinomial",
        "cauchy",
        "exponential",
        "geometric",
        "log_normal",
        # the window offsets are drawn (tests/lowering/test_coverage_ops.py gives them and checks values)
        "nn.functional.fractional_max_pool2d",
        "nn.functional.fractional_max_pool3d",
    }
)

# Entries that draw when training with a nonzero probability: entry → (where the probability
# is, a keyword or a position in args, and its default; training's default).
WHEN_TRAINING = {
    "nn.functional.dropout": (("p", 0.5), True),
    "nn.functional.dropout2d": (("p", 0.5), True),
    "nn.functional.dropout3d": (("p", 0.5), True),
    "nn.functional.alpha_dropout": (("p", 0.5), False),
    "nn.functional.feature_alpha_dropout.with_train": (("p", 0.5), False),
    "nn.functional.feature_alpha_dropout.without_train": (("p", 0.5), False),
    "nn.functional.rrelu": (None, False),
    "nn.functional.multi_head_attention_forward": ((9, 0.0), True),
}


def draws(entry: str, case) -> bool:
    """Whether this sample of `entry` draws random numbers."""
    if entry in ALWAYS:
        return True
    if entry not in WHEN_TRAINING:  # scaled_dot_product_attention and its kin
        return bool(case.kwargs.get("dropout_p", 0))
    probability, training = WHEN_TRAINING[entry]
    p = 1.0
    if probability is not None:
        where, default = probability
        if isinstance(where, int):
            p = case.args[where] if len(case.args) > where else default
        else:
            p = case.kwargs.get(where, default)
    return bool(p) and bool(case.kwargs.get("training", training))
