"""A dict that counts passes over it: a test that churns a wide fleet asserts none is made."""
from __future__ import annotations


class CountingDict(dict):
    """A dict that counts passes over it (items, values, keys, iteration)."""

    passes = 0

    def _pass(self) -> None:
        CountingDict.passes += 1

    def items(self):  # type: ignore[override]
        self._pass()
        return super().items()

    def values(self):  # type: ignore[override]
        self._pass()
        return super().values()

    def keys(self):  # type: ignore[override]
        self._pass()
        return super().keys()

    def __iter__(self):  # type: ignore[override]
        self._pass()
        return super().__iter__()
