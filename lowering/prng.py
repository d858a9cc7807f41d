"""The random-bit generator of our random ops: jax's threefry2x32, with its rounds unrolled.

jax lowers threefry2x32 on CPU as a loop of five iterations (compile time over speed). Each
iteration reads and writes the whole counter state, and XLA copies that state into and out of
the loop, a large share of a training forward with dropout. Unrolled, the twenty rounds are one
elementwise fusion (figures: docs/benchmarks.md).

`threefry_unrolled()` is a jax PRNG implementation with threefry2x32's seed and split, and a
`fold_in` and `random_bits` that give the same bits as jax's (partitionable) threefry (Salmon et
al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), computed unrolled on every
platform, as jax itself does on GPU and TPU. All of jax.random (uniform, normal, randint, ...)
works on its keys unchanged.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)
_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def threefry2x32(k1, k2, x1, x2) -> tuple:
    """Threefry-2x32, 20 rounds, of the counter pairs (x1, x2) under the key (k1, k2)."""
    keys = (k1, k2, k1 ^ k2 ^ _PARITY)
    x1, x2 = x1 + keys[0], x2 + keys[1]
    for block in range(5):
        for rotation in _ROTATIONS[block % 2]:
            x1 = x1 + x2
            x2 = x1 ^ ((x2 << np.uint32(rotation)) | (x2 >> np.uint32(32 - rotation)))
        x1 = x1 + keys[(block + 1) % 3]
        x2 = x2 + keys[(block + 2) % 3] + np.uint32(block + 1)
    return x1, x2


def _random_bits(key, bit_width: int, shape: tuple[int, ...]):
    """jax's partitionable threefry bits: element i hashes the 64-bit counter i."""
    size = math.prod(shape)
    if size >= 2**32:
        raise NotImplementedError(
            f"random bits for {size} elements: at most 2**32 - 1 per random op; draw the tensor "
            "in smaller pieces (e.g. torch.rand per chunk) and concatenate"
        )
    counters = lax.iota(jnp.uint32, size).reshape(shape)
    high, low = threefry2x32(key[0], key[1], jnp.zeros_like(counters), counters)
    dtype = _UINT[bit_width]
    if bit_width == 64:
        return (high.astype(dtype) << dtype(32)) | low.astype(dtype)
    return (high ^ low).astype(dtype)


def _fold_in(key, data):
    """jax's threefry fold_in: the key hashing the counter pair (0, data)."""
    data = jnp.asarray(data, jnp.uint32).reshape(1)
    high, low = threefry2x32(key[0], key[1], jnp.zeros_like(data), data)
    return jnp.concatenate([high, low])


@functools.cache
def threefry_unrolled():
    """The PRNG implementation (defined once per process; jax compares keys' impls by identity)."""
    from jax.extend.random import define_prng_impl, threefry_prng_impl

    return define_prng_impl(
        key_shape=threefry_prng_impl.key_shape,
        seed=threefry_prng_impl.seed,
        split=threefry_prng_impl.split,
        fold_in=_fold_in,
        random_bits=_random_bits,
        name="threefry2x32_unrolled",
        tag="tfu",
    )
