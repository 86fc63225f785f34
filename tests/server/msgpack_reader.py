"""A msgpack reader written from the msgpack specification (github.com/msgpack/msgpack/blob/master/spec.md),
independent of msgspec, which the engine encodes with: what a subscriber in another language
sees on the wire. Maps keep their keys in wire order."""

from __future__ import annotations

import struct


def unpack(data: bytes):
    value, end = _read(memoryview(data), 0)
    if end != len(data):
        raise ValueError(f"{len(data) - end} trailing bytes")
    return value


def _read(b: memoryview, i: int):
    t = b[i]
    i += 1
    if t <= 0x7F:
        return t, i
    if t >= 0xE0:
        return t - 0x100, i
    if 0x80 <= t <= 0x8F:
        return _map(b, i, t & 0x0F)
    if 0x90 <= t <= 0x9F:
        return _array(b, i, t & 0x0F)
    if 0xA0 <= t <= 0xBF:
        n = t & 0x1F
        return bytes(b[i:i + n]).decode(), i + n
    if t == 0xC0:
        return None, i
    if t in (0xC2, 0xC3):
        return t == 0xC3, i
    sized = {0xC4: 1, 0xC5: 2, 0xC6: 4}  # bin 8/16/32
    if t in sized:
        n, i = _uint(b, i, sized[t])
        return bytes(b[i:i + n]), i + n
    if t == 0xCA:
        return struct.unpack(">f", b[i:i + 4])[0], i + 4
    if t == 0xCB:
        return struct.unpack(">d", b[i:i + 8])[0], i + 8
    unsigned = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
    if t in unsigned:
        return _uint(b, i, unsigned[t])
    signed = {0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
    if t in signed:
        n = signed[t]
        return int.from_bytes(b[i:i + n], "big", signed=True), i + n
    strs = {0xD9: 1, 0xDA: 2, 0xDB: 4}
    if t in strs:
        n, i = _uint(b, i, strs[t])
        return bytes(b[i:i + n]).decode(), i + n
    if t in (0xDC, 0xDD):
        n, i = _uint(b, i, 2 if t == 0xDC else 4)
        return _array(b, i, n)
    if t in (0xDE, 0xDF):
        n, i = _uint(b, i, 2 if t == 0xDE else 4)
        return _map(b, i, n)
    raise ValueError(f"msgpack type byte {t:#x} is not one vLLM's events use")


def _uint(b: memoryview, i: int, n: int):
    return int.from_bytes(b[i:i + n], "big"), i + n


def _array(b: memoryview, i: int, n: int):
    out = []
    for _ in range(n):
        value, i = _read(b, i)
        out.append(value)
    return out, i


def _map(b: memoryview, i: int, n: int):
    out = {}
    for _ in range(n):
        key, i = _read(b, i)
        out[key], i = _read(b, i)
    return out, i
