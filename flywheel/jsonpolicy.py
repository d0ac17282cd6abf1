"""The one JSON policy of the whole system: what the gateway accepts, every reader can decode.

A JSON document is acceptable when every reader in flywheel (orjson in the consumers and the
database layer, pydantic, PostgreSQL's jsonb, SQLite's JSON1) reads it back to the same value:

- it is UTF-8 JSON text with no ``NaN``, ``Infinity`` or ``-Infinity`` (JSON has none; Python
  would read them and orjson or pydantic would write them back as ``null``);
- every integer is in ``[-2**63, 2**64 - 1]`` (orjson reads integers exactly only in that range;
  beyond it it reads a lossy double, and beyond a double's range it refuses the document: the
  poison pill of issue 21);
- every other number is finite once read as a double (``1e400`` is not);
- no string or key holds a lone UTF-16 surrogate (an escape in ``\\ud800``-``\\udfff`` that is not
  half of a pair: not Unicode, refused by orjson and by PostgreSQL);
- no object repeats a key (readers disagree on which one wins; ``{"force":false,"force":true}``);
- nesting is at most :data:`MAX_DEPTH` levels.

:func:`loads` applies the policy to text from outside (the gateway's request bodies and bus
records) and raises :class:`JSONPolicyError` naming the field (``data.a``, ``messages.0.content``)
and the rule. :func:`check` applies it to a value already in memory. :func:`db_dumps` and
:func:`db_loads` are the database layer's writer/reader pair: what the writer writes, the reader
reads, and the reader also reads rows written before this policy (integers beyond 64 bits).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson

MAX_DEPTH = 64
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1
#: A JSON escape of a UTF-16 surrogate (raw UTF-8 cannot hold one): the only way a lone one gets in.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
#: Every integer orjson reads exactly has at most 19 digits, but not every 19-digit one does.
_LONG_DIGITS = re.compile(r"[0-9]{19}")


class JSONPolicyError(ValueError):
    """A JSON document outside the policy; ``path`` names the field (``""`` for the whole body)."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}" if path else problem)


class _NonFinite(float):
    """Stands in for ``NaN``/``Infinity`` while parsing, so :func:`check` can name its field."""

    def __new__(cls, literal: str) -> _NonFinite:
        obj = super().__new__(cls, float(literal))
        obj.literal = literal  # type: ignore[attr-defined]
        return obj


class _Repeated(dict):
    """An object that repeated a key while parsing; ``repeated`` holds the first such key."""

    repeated: str


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) == len(pairs):
        return out
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            marked = _Repeated(out)
            marked.repeated = key
            return marked
        seen.add(key)
    return out  # pragma: no cover - unreachable: a shorter dict means a repeated key


def loads(raw: bytes | str) -> Any:
    """Parse ``raw`` under the policy; :class:`JSONPolicyError` (a ``ValueError``) otherwise.

    Fast path: text that orjson reads and writes back byte for byte (what pydantic and orjson
    write: every event on the bus) holds no repeated key (it would not survive the round trip),
    no integer orjson reads lossily, no NaN and no surrogate (orjson refuses both); only its
    nesting is left to check. Everything else goes through Python's parser with hooks that keep
    every breach visible to :func:`check`, which names the field."""
    if isinstance(raw, str):
        try:
            raw = raw.encode()
        except UnicodeEncodeError:
            raise JSONPolicyError("", "not Unicode text (a lone UTF-16 surrogate)") from None
    try:
        value = orjson.loads(raw)
        canonical = orjson.dumps(value) == raw
    except (orjson.JSONDecodeError, orjson.JSONEncodeError):
        canonical = False
    if canonical:
        if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _depth(value) > MAX_DEPTH:
            raise JSONPolicyError("", f"nests deeper than {MAX_DEPTH} levels")
        return value
    try:
        # Strictly decoded: json.loads(bytes) would let UTF-8-encoded surrogates through.
        text = raw.decode(json.detect_encoding(raw))
        value = json.loads(text, object_pairs_hook=_pairs, parse_constant=_NonFinite)
    except RecursionError:
        raise JSONPolicyError("", f"nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise JSONPolicyError("", f"not valid JSON: {exc}") from None
    check(value, surrogates=_SURROGATE_ESCAPE.search(text) is not None)
    return value


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), visiting containers only, without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return depth


def check(value: Any, *, surrogates: bool = True) -> None:
    """Raise :class:`JSONPolicyError` naming the first field of ``value`` outside the policy.
    ``surrogates=False`` skips the string scan (the caller knows no escape could have made one)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, dict):
            if depth >= MAX_DEPTH:
                raise JSONPolicyError(path, f"nests deeper than {MAX_DEPTH} levels")
            if isinstance(item, _Repeated):
                raise JSONPolicyError(_join(path, item.repeated), "the key appears more than once in its object")
            for key, child in item.items():
                if surrogates and _lone(key):
                    raise JSONPolicyError(path, "an object key holds a lone UTF-16 surrogate: not Unicode text")
                stack.append((child, _join(path, key), depth + 1))
        elif isinstance(item, list):
            if depth >= MAX_DEPTH:
                raise JSONPolicyError(path, f"nests deeper than {MAX_DEPTH} levels")
            if _plain_numbers(item):
                continue
            stack.extend((child, _join(path, str(i)), depth + 1) for i, child in enumerate(item))
        else:
            _check_scalar(item, path, surrogates)


def _plain_numbers(items: list[Any]) -> bool:
    """True for a list of in-range ints or of finite plain floats (token ids, logprobs), checked
    at C speed; anything else is walked item by item."""
    kinds = set(map(type, items))
    if kinds == {int}:
        return INT_MIN <= min(items) and max(items) <= INT_MAX
    if kinds == {float}:
        return all(map(math.isfinite, items))
    return False


def _check_scalar(item: Any, path: str, surrogates: bool) -> None:
    if isinstance(item, str):
        if surrogates and _lone(item):
            raise JSONPolicyError(path, "holds a lone UTF-16 surrogate (an escape in \\ud800-\\udfff that is "
                                        "not half of a pair): not Unicode text")
    elif isinstance(item, bool) or item is None:
        return
    elif isinstance(item, int):
        if not INT_MIN <= item <= INT_MAX:
            raise JSONPolicyError(path, f"integer of {len(str(abs(item)))} digits is outside "
                                        f"[-2**63, 2**64 - 1], the range every reader handles exactly")
    elif isinstance(item, _NonFinite):
        raise JSONPolicyError(path, f"{item.literal} is not JSON (numbers must be finite)")  # type: ignore[attr-defined]
    elif isinstance(item, float):
        if not math.isfinite(item):
            raise JSONPolicyError(path, "number overflows a double (numbers must be finite)")
    else:
        raise JSONPolicyError(path, f"{type(item).__name__} is not a JSON value")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _lone(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def db_dumps(value: Any) -> str:
    """The database layer's writer: orjson, or Python's encoder for what orjson refuses (integers
    beyond 64 bits, in rows from before the policy); :func:`db_loads` reads both. A NaN or an
    infinity raises ``ValueError`` (orjson would write ``null``: a value changed behind the
    caller's back)."""
    try:
        out = orjson.dumps(value)
    except TypeError:
        return json.dumps(value, allow_nan=False)
    if b"null" in out and not _all_finite(value):
        raise ValueError("a NaN or infinite number cannot be stored as JSON")
    return out.decode()


def _all_finite(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return True


def db_loads(raw: str | bytes) -> Any:
    """The database layer's reader: orjson, or Python's parser where orjson would be wrong or
    refuse (a run of 19+ digits may be an integer beyond 64 bits, which orjson reads as a lossy
    double or refuses; written by :func:`db_dumps`, or before the policy). Never a poison pill for
    a row the writer wrote, and never a changed value."""
    if _LONG_DIGITS.search(raw if isinstance(raw, str) else raw.decode()) is None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)
