"""Which Flink subtask owns a key that Beam's Flink runner keys by: Flink's key-group assignment, in Python.

Why it is here: Beam's portable Flink runner keys a splittable DoFn's input by the element's encoded bytes
(``SdfByteBufferKeySelector``: the element as encoded by its coder, in a ``java.nio.ByteBuffer``), and Flink sends
each key to the subtask that owns its key group. So which read subtask reads which Kafka partition is decided by a
hash of the partition's descriptor, not by its number: with four partitions and two subtasks, one subtask got three
of them in a measured run (``docs/streaming.md``), and the job ran at the pace of that one. Knowing the assignment
lets the read pick descriptors that spread partitions round robin, as Flink's own ``KafkaSource`` assigns them.

The functions follow Flink 1.19's ``KeyGroupRangeAssignment``, ``MathUtils.murmurHash`` and ``ByteBuffer.hashCode``
bit for bit (``tests/unit/test_flink_keys.py`` holds values computed by Flink's own classes). Plain Python, no Beam.
"""

from __future__ import annotations

__all__ = ["default_max_parallelism", "length_prefixed", "subtask_of_key"]

_MASK = 0xFFFFFFFF


def _int32(value: int) -> int:
    value &= _MASK
    return value - (1 << 32) if value & 0x80000000 else value


def _rotl(value: int, bits: int) -> int:
    value &= _MASK
    return ((value << bits) | (value >> (32 - bits))) & _MASK


def _byte_buffer_hash(data: bytes) -> int:
    """``java.nio.ByteBuffer.hashCode()``: 31-based over the signed bytes, from the last byte to the first."""
    h = 1
    for byte in reversed(data):
        h = _int32(31 * h + (byte - 256 if byte > 127 else byte))
    return h


def _murmur_hash(code: int) -> int:
    """Flink's ``MathUtils.murmurHash(int)``: one murmur3 round plus the finalizer, made non-negative."""
    code = (code * 0xCC9E2D51) & _MASK
    code = _rotl(code, 15)
    code = (code * 0x1B873593) & _MASK
    code = _rotl(code, 13)
    code = (code * 5 + 0xE6546B64) & _MASK
    code ^= 4
    code ^= code >> 16
    code = (code * 0x85EBCA6B) & _MASK
    code ^= code >> 13
    code = (code * 0xC2B2AE35) & _MASK
    code ^= code >> 16
    signed = _int32(code)
    if signed >= 0:
        return signed
    return -signed if signed != -(1 << 31) else 0


def default_max_parallelism(parallelism: int) -> int:
    """Flink's ``KeyGroupRangeAssignment.computeDefaultMaxParallelism``: used when the job sets none."""
    rounded = 1 << max(0, (parallelism + parallelism // 2 - 1).bit_length())
    return min(max(rounded, 128), 32768)


def subtask_of_key(key: bytes, max_parallelism: int, parallelism: int) -> int:
    """The subtask index (0-based) that owns a ``ByteBuffer`` key of these bytes."""
    if not 0 < parallelism <= max_parallelism:
        raise ValueError(f"parallelism {parallelism} must be in 1..max_parallelism ({max_parallelism})")
    key_group = _murmur_hash(_byte_buffer_hash(key)) % max_parallelism
    return key_group * parallelism // max_parallelism


def length_prefixed(encoded: bytes) -> bytes:
    """The runner's view of an element whose coder only Python knows: ``LengthPrefixCoder(ByteArrayCoder)``, nested,
    i.e. a varint length and the bytes. This is the key ``SdfByteBufferKeySelector`` hashes for such an element."""
    out = bytearray()
    n = len(encoded)
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out) + encoded
