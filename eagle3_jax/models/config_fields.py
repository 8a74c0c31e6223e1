"""Typed reads of a JSON config object: every field the library reads is checked to have the type it
means, and a wrong one raises CheckpointError naming the file and the key.

JSON has one number type, so an int field refuses 4.5 (and 4.0), and no numeric field takes a bool;
`null` reads as absent (transformers writes `null` for unset optional fields).
"""

from __future__ import annotations

import math
from typing import Any

from eagle3_jax.errors import CheckpointError

_REQUIRED = object()


class Fields:
    """One config object, or several layered ones (the first that holds a key wins), read by type."""

    def __init__(self, where: str, *layers: tuple[Any, str]):
        """layers: (object, prefix naming it in messages, e.g. "rope_scaling.") pairs, first one first."""
        self.where = str(where)
        self.layers = tuple((obj, prefix) for obj, prefix in layers if obj is not None)

    @classmethod
    def of(cls, raw: dict, where) -> "Fields":
        return cls(str(where), (raw, ""))

    def _lookup(self, key: str) -> tuple[Any, str]:
        for obj, prefix in self.layers:
            if key in obj:
                return obj[key], prefix + key
        return None, (self.layers[0][1] if self.layers else "") + key

    def has(self, key: str) -> bool:
        """Whether the key is present and not null."""
        return self._lookup(key)[0] is not None

    def _get(self, key: str, default, kind: str, ok):
        value, name = self._lookup(key)
        if value is None:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.where}: missing required key {name!r}")
            return default
        if not ok(value):
            raise CheckpointError(f"{self.where}: {name} must be {kind}, got {value!r}")
        return value

    def int(self, key: str, default=_REQUIRED, minimum: int | None = None) -> int:
        """An integer field; with `minimum`, one below it is refused too (a size of 0 or less)."""
        if minimum is None:
            return self._get(key, default, "an integer", _is_int)
        return self._get(key, default, f"an integer >= {minimum}", lambda v: _is_int(v) and v >= minimum)

    def float(self, key: str, default=_REQUIRED) -> float:
        value = self._get(key, default, "a finite number", _is_number)
        return value if value is None else float(value)

    def bool(self, key: str, default=_REQUIRED) -> bool:
        return self._get(key, default, "true or false", lambda v: isinstance(v, bool))

    def str(self, key: str, default=_REQUIRED) -> str:
        return self._get(key, default, "a string", lambda v: isinstance(v, str))

    def ints(self, key: str, default=_REQUIRED) -> tuple[int, ...]:
        value = self._get(key, default, "a list of integers", lambda v: isinstance(v, list) and all(map(_is_int, v)))
        return value if value is None else tuple(value)

    def strs(self, key: str, default=_REQUIRED) -> tuple[str, ...]:
        value = self._get(key, default, "a list of strings",
                          lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v))
        return value if value is None else tuple(value)

    def obj(self, key: str) -> dict | None:
        """A nested object, or None when absent or null."""
        return self._get(key, None, "an object", lambda v: isinstance(v, dict))

    def nested(self, key: str) -> "Fields":
        """A nested object as Fields (empty when absent), its keys named `key.inner` in messages."""
        _, name = self._lookup(key)
        return Fields(self.where, (self.obj(key) or {}, name + "."))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)
