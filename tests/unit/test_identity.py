"""End users' identity (flywheel/identity.py): the keyed hash, the secret made once in the data
directory, which id a request names, and what the capture records and sends upstream in its place."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import threading

import pytest

from flywheel import identity
from flywheel.events import GenerationEvent
from flywheel.settings import REDACTED, SettingsError, load_settings, redacted
from serving.gateway import capture

SECRET = "s" * 40
RAW = "alice@example.com"
MESSAGES = [{"role": "user", "content": "sort 3 1 2"}]


def test_the_hash_is_hmac_sha256_of_tenant_and_id_under_the_secret() -> None:
    expected = hmac.new(SECRET.encode(), b"acme\x00" + RAW.encode(), hashlib.sha256).hexdigest()
    assert identity.user_hash(SECRET, "acme", RAW) == expected
    assert identity.user_hash(SECRET, "acme", RAW) == identity.user_hash(SECRET, "acme", RAW)  # stable
    others = {identity.user_hash("t" * 40, "acme", RAW),  # another deployment
              identity.user_hash(SECRET, "evil", RAW),  # another tenant's "alice" is another person
              identity.user_hash(SECRET, "acme", "Alice@example.com"),  # compared exactly
              identity.user_hash(SECRET, "acme", RAW + " "),
              identity.user_hash(SECRET, "acm", "e\x00" + RAW)}  # the separator cannot be forged by a tenant
    assert expected not in others and len(others) == 5
    assert RAW not in expected and len(expected) == 64


def test_the_secret_is_made_once_private_and_read_back(tmp_path) -> None:
    data = tmp_path / "data"
    first = identity.load_secret("", data)
    path = data / identity.SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert len(first) == 64 and int(first, 16) >= 0
    assert identity.load_secret("", data) == first  # the next start reads the same one
    assert identity.load_secret("", tmp_path / "other") != first  # another deployment, another secret
    assert [p.name for p in data.iterdir()] == [identity.SECRET_FILE]  # no temporary file left behind
    assert identity.load_secret("x" * 32, data) == "x" * 32  # the setting wins over the file


def test_processes_starting_at_once_agree_on_one_secret(tmp_path) -> None:
    data = tmp_path / "data"
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(identity.load_secret("", data))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1


def test_a_damaged_secret_stops_the_gateway_rather_than_being_replaced(tmp_path) -> None:
    path = tmp_path / identity.SECRET_FILE
    path.write_text("short\n")
    with pytest.raises(identity.SecretError, match="damaged"):
        identity.load_secret("", tmp_path)
    assert path.read_text() == "short\n"
    path.write_bytes(b"\xff" * 40)
    with pytest.raises(identity.SecretError, match="cannot read"):
        identity.load_secret("", tmp_path)
    with pytest.raises(identity.SecretError, match="at least 32"):
        identity.load_secret("too short", tmp_path)


def test_the_setting_is_a_secret_of_at_least_32_characters(tmp_path) -> None:
    secret = "k" * 40
    settings = load_settings(data_dir=str(tmp_path), gateway={"user_id_secret": secret})
    assert redacted(settings)["gateway"]["user_id_secret"] == REDACTED
    assert secret not in json.dumps(redacted(settings)) and secret not in repr(settings)
    assert redacted(load_settings(data_dir=str(tmp_path)))["gateway"]["user_id_secret"] == ""
    with pytest.raises(SettingsError) as err:
        load_settings(gateway={"user_id_secret": "hunter2-weak"})
    assert "gateway.user_id_secret" in str(err.value) and "hunter2-weak" not in str(err.value)


@pytest.mark.parametrize(("body", "header", "expected"), [
    (None, None, None),
    ("", None, None),  # an empty id names nobody
    (None, "", None),
    (RAW, None, RAW),
    (None, RAW, RAW),
    (RAW, RAW, RAW),  # both, the same: fine
    ("", RAW, RAW),
])
def test_which_end_user_a_request_names(body, header, expected) -> None:
    assert identity.end_user(body, header) == expected


LONG = "a" * (identity.MAX_USER_CHARS + 1)


@pytest.mark.parametrize(("body", "header", "code"), [
    (RAW, "bob@example.com", "user_conflict"), (7, None, "invalid_user"), (["alice"], None, "invalid_user"),
    (LONG, None, "invalid_user"), (None, LONG, "invalid_user"),  # longer than the data routes could ever erase
])
def test_two_different_users_a_user_that_is_not_a_string_or_one_too_long_are_refused(body, header, code) -> None:
    with pytest.raises(identity.EndUserError) as err:
        identity.end_user(body, header)
    assert err.value.code == code
    assert RAW not in str(err.value) and "bob" not in str(err.value) and LONG not in str(err.value)  # no id repeated
    assert identity.end_user("a" * identity.MAX_USER_CHARS, None) == "a" * identity.MAX_USER_CHARS


def test_the_capture_records_and_sends_only_the_hash() -> None:
    hashed = identity.user_hash(SECRET, "acme", RAW)
    body = {"messages": MESSAGES, "user": RAW, "temperature": 0.5}
    upstream = capture.upstream_request(body, "line", "chat", hashed)
    assert upstream["user"] == hashed and RAW not in json.dumps(upstream)
    assert "user" not in capture.upstream_request({"messages": MESSAGES, "user": ""}, "line")
    assert body["user"] == RAW  # the client's body is not changed in place
    served = capture.Served(1, "n", [1, 2], [7], [-0.1], "stop")
    (event,) = capture.generation_events(request_id="g", tenant="acme", session_id="s", model_line="m",
                                         request_body=body, response_body={}, served=[served], latency_ms=1.0,
                                         sampling_defaults={}, user_hash=hashed)
    wire = event.to_bytes()
    assert RAW.encode() not in wire and "user" not in event.request
    assert event.request == {"messages": MESSAGES, "temperature": 0.5}
    assert GenerationEvent.from_bytes(wire).user_hash == hashed


def test_the_event_takes_only_a_hash_and_reads_events_from_before_it() -> None:
    served = capture.Served(1, "n", [1], [7], [-0.1], "stop")
    (event,) = capture.generation_events(request_id="g", tenant="acme", session_id="s", model_line="m",
                                         request_body={"messages": MESSAGES}, response_body={}, served=[served],
                                         latency_ms=1.0, sampling_defaults={})
    assert event.user_hash is None
    old = json.loads(event.to_bytes())
    assert "user_hash" not in old  # without an end user the event is what a consumer of before it reads
    assert GenerationEvent.from_bytes(json.dumps(old).encode()).user_hash is None
    named = event.model_copy(update={"user_hash": "ab" * 32})
    assert GenerationEvent.from_bytes(named.to_bytes()).user_hash == "ab" * 32
    with pytest.raises(ValueError):
        GenerationEvent.from_bytes(json.dumps({**old, "user_hash": RAW}).encode())


def test_the_secret_is_private_whatever_the_umask(tmp_path) -> None:
    previous = os.umask(0)  # the secret is private even when the process umask is not
    try:
        identity.load_secret("", tmp_path / "loose")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "loose" / identity.SECRET_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "loose").stat().st_mode) == 0o700
