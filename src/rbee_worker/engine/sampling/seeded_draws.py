"""The sampler's random numbers: a counter-based generator (SplitMix64) where a row's draw number `counter` of its
request is a function of (seed, counter) alone, so that a seeded request draws the same numbers whatever else runs
beside it and on any device (int64 tensors on the device, numpy arrays or Python integers on the host)."""

from typing import TypeVar

import numpy as np
import torch

from rbee_worker.engine.sampling.selection import FRACTION_BITS

# SplitMix64 (Steele, Lea, Flood 2014), as signed 64-bit constants: torch's int64 multiplication wraps.
_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_MIX_1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX_2 = 0x94D049BB133111EB - 2**64
_MASK_64 = 2**64 - 1
Int64s = TypeVar("Int64s", torch.Tensor, np.ndarray)  # SplitMix64's operands: int64 tensors or numpy arrays


def check_seed(seed: int) -> int:
    """The seed, if the API accepts it (0..2**64-1; every bit counts)."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in 0..2**64-1, got {seed}")
    return seed


def stream_of(seeds: torch.Tensor) -> torch.Tensor:
    """mix(seed) + GAMMA, what `draw_bits` needs of a seed (int64 tensors, seeds as two's complement; SamplerState
    keeps this, not the seed)."""
    return _mix(seeds) + _GAMMA


def draw_bits(streams: Int64s, counters: Int64s) -> Int64s:
    """The uniform number of each row's draw number `counter` (0, 1, ...) of its stream (`stream_of` of its seed), as an
    int64 k in [0, 2**53): the number is k / 2**53, kept an integer for the draw's exact integer arithmetic (MPS has no
    float64). It is SplitMix64's output number counter + 1 from the state mix(seed): mix(mix(seed) + (counter + 1) *
    GAMMA), top 53 bits. A function of (seed, counter) alone, so a row's draws do not depend on the batch; every bit
    of the seed counts; mixing the seed first keeps the streams of nearby seeds apart (SplitMix64's streams from seeds
    s and s + GAMMA would be one stream shifted by one). int64 tensors or numpy arrays, whose arithmetic wraps
    alike."""
    return _shift_right(_mix(streams + counters * _GAMMA), 64 - FRACTION_BITS)


def draw_bits_of(stream: int, counter: int) -> int:
    """`draw_bits` of one row in Python integers (the same number): `stream` as SamplerState keeps it (int64)."""
    z = (stream + counter * _GAMMA) & _MASK_64
    z = ((z ^ (z >> 30)) * _MIX_1) & _MASK_64
    z = ((z ^ (z >> 27)) * _MIX_2) & _MASK_64
    return (z ^ (z >> 31)) >> (64 - FRACTION_BITS)


def _shift_right(z: Int64s, bits: int) -> Int64s:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: Int64s) -> Int64s:
    """SplitMix64's output function, a bijection of 64-bit values."""
    z = (z ^ _shift_right(z, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    return z ^ _shift_right(z, 31)
