"""Which partition Spark's hash partitioning sends a value to, computed here, so the driver can
choose values that land rows in the barrier task it wants.

``df.repartition(n, col)`` puts a row in partition ``pmod(murmur3(col), n)``, Murmur3 x86_32
with seed 42 (Spark's ``HashPartitioning``; the same hash as SQL's ``hash()``, kept stable
because bucketed tables depend on it). Routing a row to task ``p`` therefore means giving it a
value whose hash lands in ``p``: ``route_keys(n)[p]``.
"""

from __future__ import annotations

_SEED = 42
_MASK = 0xFFFFFFFF


def _rotl(value: int, bits: int) -> int:
    return ((value << bits) | (value >> (32 - bits))) & _MASK


def spark_hash_int(value: int) -> int:
    """Spark's ``hash(CAST(value AS INT))``: Murmur3 x86_32 of one int, seed 42, signed."""
    k1 = (value & _MASK) * 0xCC9E2D51 & _MASK
    k1 = _rotl(k1, 15) * 0x1B873593 & _MASK
    h1 = _rotl(_SEED ^ k1, 13)
    h1 = (h1 * 5 + 0xE6546B64) & _MASK
    h1 ^= 4  # the input's length in bytes
    h1 ^= h1 >> 16
    h1 = h1 * 0x85EBCA6B & _MASK
    h1 ^= h1 >> 13
    h1 = h1 * 0xC2B2AE35 & _MASK
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


def partition_of(value: int, num_partitions: int) -> int:
    """The partition ``repartition(num_partitions, col)`` gives an int column's ``value``."""
    return spark_hash_int(value) % num_partitions  # Python's % is Spark's pmod for n > 0


def route_keys(num_partitions: int) -> list[int]:
    """For each partition, the smallest non-negative int that Spark hashes into it."""
    keys: dict[int, int] = {}
    value = 0
    while len(keys) < num_partitions:
        keys.setdefault(partition_of(value, num_partitions), value)
        value += 1
    return [keys[p] for p in range(num_partitions)]
