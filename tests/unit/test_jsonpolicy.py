"""The system's one JSON policy (``flywheel.jsonpolicy``): hand-made breaches named by field, the
fast path agreeing with the strict one on random documents, and the database's writer/reader pair."""

from __future__ import annotations

import json
import random

import orjson
import pytest

from flywheel import jsonpolicy
from flywheel.jsonpolicy import JSONPolicyError, db_dumps, db_loads

pytestmark = pytest.mark.unit

BIG = "9" * 4000


@pytest.mark.parametrize("raw, path, words", [
    (b'{"a":' + BIG.encode() + b"}", "a", "4000 digits"),
    (b'{"a":18446744073709551616}', "a", "outside"),
    (b'{"a":-9223372036854775809}', "a", "outside"),
    (b'{"a":{"b":[0, 1e400]}}', "a.b.1", "overflows"),
    (b'{"a":NaN}', "a", "NaN"),
    (b'[Infinity]', "0", "Infinity"),
    (b'{"x":[{"y":-Infinity}]}', "x.0.y", "-Infinity"),
    (b'{"force":false,"force":true}', "force", "more than once"),
    (b'{"m":{"k":1,"j":2,"k":3}}', "m.k", "more than once"),
    (b'{"s":"\\ud800"}', "s", "surrogate"),
    (b'{"\\udfff":1}', "", "surrogate"),
    (b"[" * 65 + b"]" * 65, "", "deeper than 64"),
    (b"[" * 100_000 + b"]" * 100_000, "", "deeper than 64"),
    (b'{"a":1', "", "not valid JSON"),
    (b"\xff", "", "not valid JSON"),
])
def test_each_breach_is_refused_naming_its_field(raw, path, words):
    with pytest.raises(JSONPolicyError) as caught:
        jsonpolicy.loads(raw)
    assert caught.value.path == path and words in str(caught.value)


@pytest.mark.parametrize("raw", [
    b'{"a":18446744073709551615,"b":-9223372036854775808}', b'"\\ud83d\\ude00"', b"[" * 64 + b"]" * 64,
    b'{"a":1e308,"b":1e-400,"c":-0.0}', b'{"t":[1,2,3],"l":[-0.5,-1.25]}', b"null",
])
def test_what_every_reader_handles_is_accepted_unchanged(raw):
    assert jsonpolicy.loads(raw) == json.loads(raw)


def _random_value(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth < 4 and roll < 0.2:
        return {rng.choice("abcdef") + str(rng.randrange(3)): _random_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    if depth < 4 and roll < 0.4:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return rng.choice([
        None, True, rng.randrange(-(2**63), 2**64), rng.randrange(-(2**70), 2**70), rng.uniform(-1e300, 1e300),
        float("nan"), float("inf"), "plain", "é😀", "\ud800", rng.randrange(10) * [rng.randrange(2**64)],
    ])


def test_the_fast_path_and_the_strict_path_agree_on_random_documents():
    """Fresh random documents, written compactly (the fast path) and spaced (the strict path): the
    same value or the same refusal, and what is refused is exactly what some reader cannot read."""
    rng = random.Random()
    for _ in range(3000):
        value = {"v": _random_value(rng)}
        try:
            compact = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
            spaced = json.dumps(value, indent=1).encode()
        except ValueError:
            continue
        outcomes = []
        for raw in (compact, spaced):
            try:
                outcomes.append(("ok", jsonpolicy.loads(raw)))
            except JSONPolicyError as exc:
                outcomes.append(("refused", exc.path))
        assert outcomes[0][0] == outcomes[1][0], (value, outcomes)
        if outcomes[0][0] == "ok":
            assert outcomes[0][1] == outcomes[1][1] == orjson.loads(orjson.dumps(outcomes[0][1]))


def test_the_database_pair_reads_what_it_writes_even_beyond_64_bits():
    """The issue's poison pill: a row holding an integer orjson cannot read (written by the old
    fallback) made every later read of its session crash. The reader now reads every row the writer
    writes."""
    for value in ({"a": 10**4000}, {"a": 2**64}, {"a": [1, -2.5, "x", None]}, {"deep": [[[[{"k": 1}]]]]}):
        assert db_loads(db_dumps(value)) == value
    with pytest.raises(ValueError):
        db_dumps({"a": float("nan")})  # never stored as null behind anyone's back
