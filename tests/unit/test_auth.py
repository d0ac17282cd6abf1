"""API key format and hashing, bearer parsing, the token bucket and tenant-scoped state keys: pure parts."""

from __future__ import annotations

import hashlib
import re
import secrets

import pytest

from flywheel.keys import KEY_PREFIX, check_tenant, key_hash, key_id_of, new_key
from serving.errors import APIError
from serving.gateway.auth import INVALID_KEY_MESSAGE, Principal, bearer_token, invalid_key, require_admin
from serving.gateway.state import bucket_capacity, session_key, take_token

pytestmark = pytest.mark.unit


def test_new_keys_have_the_documented_format_and_are_unique():
    seen_ids, seen_keys = set(), set()
    for _ in range(500):
        key_id, key = new_key()
        assert re.fullmatch(r"fwk_[0-9a-f]{12}_[0-9a-f]{64}", key), key
        assert key.startswith(f"{KEY_PREFIX}{key_id}_")
        assert key_id_of(key) == key_id
        seen_ids.add(key_id)
        seen_keys.add(key)
    assert len(seen_ids) == len(seen_keys) == 500


def test_key_hash_is_sha256_of_the_whole_key():
    _, key = new_key()
    assert key_hash(key) == hashlib.sha256(key.encode()).hexdigest()
    # One flipped secret character changes the hash: the whole key is hashed, not only the id.
    flipped = key[:-1] + ("0" if key[-1] != "0" else "1")
    assert key_id_of(flipped) == key_id_of(key)
    assert key_hash(flipped) != key_hash(key)


def test_malformed_keys_have_no_key_id():
    key_id, key = new_key()
    secret = key.rsplit("_", 1)[1]
    bad = [
        "",
        "fwk_",
        key + "0",
        key[:-1],
        key.upper(),
        " " + key,
        key + "\n",
        f"sk_{key_id}_{secret}",
        f"fwk-{key_id}-{secret}",
        f"fwk_{key_id}{secret}",
        f"fwk_{key_id[:-1]}g_{secret}",
        f"fwk_{key_id}_{secret[:-1]}z",
        f"fwk_{key_id}_{secrets.token_urlsafe(32)}",
    ]
    for candidate in bad:
        assert key_id_of(candidate) is None, candidate


def test_bearer_token_parsing():
    _, key = new_key()
    assert bearer_token(f"Bearer {key}") == key
    assert bearer_token(f"bearer  {key} ") == key
    assert bearer_token(f"BEARER {key}") == key
    for header in (None, "", "Bearer", "Bearer ", key, f"Basic {key}", f"Token {key}"):
        assert bearer_token(header) is None, header


def test_tenant_names():
    for ok in ("acme", "a", "Acme-Corp_2.eu", "team@acme", "x" * 128):
        assert check_tenant(ok) == ok
    for bad in ("", "-acme", "acme corp", "a:b", "a/b", "é", "x" * 129, "a\nb"):
        with pytest.raises(ValueError, match="invalid tenant name"):
            check_tenant(bad)


def test_invalid_key_error_is_one_message_without_the_key():
    err = invalid_key()
    assert err.status == 401 and err.code == "invalid_api_key" and err.type == "authentication_error"
    assert err.message == INVALID_KEY_MESSAGE and "fwk_..." in err.message
    assert err.headers == {"WWW-Authenticate": "Bearer"}


def test_require_admin():
    require_admin(Principal("k1", "ops", "admin", None))
    with pytest.raises(APIError) as caught:
        require_admin(Principal("k2", "acme", "tenant", 60))
    assert caught.value.status == 403 and caught.value.code == "admin_required"


def test_bucket_capacity_defaults_to_a_sixth_of_rpm():
    assert bucket_capacity(60, 5) == 5
    assert bucket_capacity(60, 0) == 10
    assert bucket_capacity(61, 0) == 11
    assert bucket_capacity(1, 0) == 1


def test_take_token_by_hand():
    # rpm 60: one token per second; burst 2.
    tokens, retry = take_token(None, 0.0, 100.0, 60, 2)  # a new bucket is full
    assert (tokens, retry) == (1.0, None)
    tokens, retry = take_token(tokens, 100.0, 100.0, 60, 2)
    assert (tokens, retry) == (0.0, None)
    tokens, retry = take_token(tokens, 100.0, 100.25, 60, 2)  # 0.25 refilled, 0.75 s to go
    assert tokens == pytest.approx(0.25) and retry == pytest.approx(0.75)
    tokens, retry = take_token(tokens, 100.25, 101.0, 60, 2)  # 1.0 now: admitted
    assert tokens == pytest.approx(0.0) and retry is None
    tokens, retry = take_token(0.0, 101.0, 1000.0, 60, 2)  # a long pause refills only to capacity
    assert (tokens, retry) == (1.0, None)
    # rpm 6: a token every 10 s.
    tokens, retry = take_token(0.5, 0.0, 0.0, 6, 1)
    assert tokens == 0.5 and retry == pytest.approx(5.0)
    # A clock that went backwards refills nothing (and takes nothing away).
    tokens, retry = take_token(0.5, 10.0, 9.0, 60, 2)
    assert tokens == 0.5 and retry == pytest.approx(0.5)


def test_session_keys_are_scoped_by_tenant_without_collisions():
    assert session_key("a:b", "c") != session_key("a", "b:c")
    assert session_key("a", "1:x") != session_key("a:1", "x")
    assert session_key("acme", "s1") != session_key("other", "s1")
    assert session_key("acme", "s1") == session_key("acme", "s1")
