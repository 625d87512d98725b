"""A batch job's key sets in bounded bytes per key: each key is held as its 128-bit digest, not its text.

A million-line job holds every key more than once: to number repeats, to drop a record written twice,
and, on a resume, the keys done. As Python strings in a dict or set those cost 100 to 200 bytes a key.
Here a key costs one slot of 20 bytes (a 128-bit digest as two int64, and an int32 value) in an
open-addressed table at most half full. Two keys are taken as the same when their digests are, the rule
a line without an id already lives by (its key is a 128-bit hash of its bytes): a false match among a
billion keys has odds under 1e-20. The digests are of this process (see _digest); a table is never saved.

Imports only the standard library (the CLI checks files before jax loads).
"""

import array
from collections.abc import Iterable

_EMPTY = -1  # the value of an unused slot; stored values are >= 0
_MIN_SLOTS = 64


def _digest(key: str) -> tuple[int, int]:
    """Two 64-bit SipHash values: Python's own hash of the key (cached on the string), and of the key with a
    NUL appended. Under the process's hash secret these are independent, so together they are a 128-bit digest."""
    return hash(key), hash(key + "\0")


class KeyTable:
    """str -> int (>= 0), or a set of str (`add`, `in`); keys cannot be listed back or removed."""

    def __init__(self, keys: Iterable[str] = ()):
        self._size = 0
        self._allocate(_MIN_SLOTS)
        for key in keys:
            self.add(key)

    def _allocate(self, num_slots: int) -> None:
        self._mask = num_slots - 1
        self._low = array.array("q", bytes(8 * num_slots))
        self._high = array.array("q", bytes(8 * num_slots))
        self._values = array.array("i", [_EMPTY]) * num_slots

    def _slot(self, low: int, high: int) -> int:
        """The slot holding (low, high), or the empty slot where it would go (linear probing)."""
        slot = low & self._mask
        while self._values[slot] != _EMPTY and (self._low[slot] != low or self._high[slot] != high):
            slot = (slot + 1) & self._mask
        return slot

    def setdefault(self, key: str, value: int) -> int:
        """The value stored for `key`, storing `value` (>= 0) first when there is none."""
        if value < 0:
            raise ValueError(f"a KeyTable value must be >= 0, got {value}")
        low, high = _digest(key)
        slot = self._slot(low, high)
        if self._values[slot] != _EMPTY:
            return self._values[slot]
        self._low[slot], self._high[slot], self._values[slot] = low, high, value
        self._size += 1
        if 2 * self._size > self._mask + 1:
            self._grow()
        return value

    def add(self, key: str) -> None:
        self.setdefault(key, 0)

    def get(self, key: str, default: int | None = None) -> int | None:
        slot = self._slot(*_digest(key))
        return default if self._values[slot] == _EMPTY else self._values[slot]

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def __len__(self) -> int:
        return self._size

    def _grow(self) -> None:
        low, high, values = self._low, self._high, self._values
        self._allocate(2 * (self._mask + 1))
        for i, value in enumerate(values):
            if value != _EMPTY:
                slot = self._slot(low[i], high[i])
                self._low[slot], self._high[slot], self._values[slot] = low[i], high[i], value

