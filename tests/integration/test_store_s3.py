"""The S3 weight store against a real S3-protocol server (moto's, in this process, over HTTP):
objects, prefixes that isolate, keys that cannot escape, damaged objects caught, and the registry
publishing and loading a delta chain through it."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from flywheel.settings import load_settings
from flywheel.weights.registry import Registry, WeightsError
from flywheel.weights.store import InvalidKey, ObjectNotFound, S3Store, StoreError, make_store
from tests.integration.test_registry import assert_bit_exact, make_state, train_step

pytestmark = pytest.mark.integration

BUCKET = "weights"


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    from testbed.procs import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket=BUCKET)
    yield client
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for item in page.get("Contents", ()):
            client.delete_object(Bucket=BUCKET, Key=item["Key"])
    client.delete_bucket(Bucket=BUCKET)


def test_objects_round_trip_under_their_prefix(s3, s3_endpoint: str) -> None:
    store = S3Store(BUCKET, "team-a/", endpoint_url=s3_endpoint)
    other = S3Store(BUCKET, "team-b/", endpoint_url=s3_endpoint)
    store.put("line/v00000001.full", b"\x00" * 1000 + b"weights")
    store.put("line/v00000002.delta", b"delta")
    other.put("line/v00000001.full", b"someone else's")

    assert store.get("line/v00000001.full") == b"\x00" * 1000 + b"weights"
    assert store.exists("line/v00000002.delta") and not store.exists("line/v00000003.delta")
    assert store.list() == ["line/v00000001.full", "line/v00000002.delta"]
    assert store.list("line/v00000002") == ["line/v00000002.delta"]
    assert other.list() == ["line/v00000001.full"] and other.get("line/v00000001.full") == b"someone else's"
    with pytest.raises(ObjectNotFound):
        store.get("line/v00000003.delta")
    store.delete("line/v00000001.full")
    store.delete("line/v00000001.full")  # deleting twice is fine
    assert store.list() == ["line/v00000002.delta"]
    assert sorted(item["Key"] for item in s3.list_objects_v2(Bucket=BUCKET)["Contents"]) == [
        "team-a/line/v00000002.delta", "team-b/line/v00000001.full"]


def test_ranges_of_an_object_are_what_the_object_holds(s3, s3_endpoint: str) -> None:
    """A node reads an anchor by ranged GETs: exactly the bytes asked for, or an error."""
    store = S3Store(BUCKET, "team-a/", endpoint_url=s3_endpoint)
    body = bytes(range(256)) * 40
    store.put("line/v00000001.full", body)
    assert store.size("line/v00000001.full") == len(body)
    for offset, length in ((0, 8), (1000, 3000), (len(body) - 1, 1), (17, 0)):
        assert store.get_range("line/v00000001.full", offset, length) == body[offset : offset + length]
    with pytest.raises(StoreError, match="received"):
        store.get_range("line/v00000001.full", len(body) - 4, 8)  # past the end: S3 answers what it has
    with pytest.raises(ObjectNotFound):
        store.get_range("line/v00000002.full", 0, 8)
    with pytest.raises(ObjectNotFound):
        store.size("line/v00000002.full")


@pytest.mark.parametrize("key", ["../team-b/line/v1.full", "line/../../team-b/x", "/team-b/x", "line//x", ".hidden",
                                 "line/..", "line\\..\\x", "%2e%2e/x", "", "a" * 1025])
def test_keys_cannot_leave_the_prefix(s3, s3_endpoint: str, key: str) -> None:
    other = S3Store(BUCKET, "team-b/", endpoint_url=s3_endpoint)
    other.put("x", b"secret")
    store = S3Store(BUCKET, "team-a/", endpoint_url=s3_endpoint)
    for attempt in (lambda: store.put(key, b"overwrite"), lambda: store.get(key), lambda: store.delete(key),
                    lambda: store.exists(key)):
        with pytest.raises(InvalidKey):
            attempt()
    with pytest.raises(InvalidKey):
        store.list("../")
    assert other.get("x") == b"secret"
    assert [item["Key"] for item in s3.list_objects_v2(Bucket=BUCKET)["Contents"]] == ["team-b/x"]


def test_bad_prefixes_and_an_unreachable_server_are_refused(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for prefix in ("no-slash", "../up/", "/abs/", "a//"):
        with pytest.raises(InvalidKey):
            S3Store(BUCKET, prefix, endpoint_url=s3_endpoint)
    with pytest.raises(StoreError):
        S3Store("", "x/")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    missing = S3Store("no-such-bucket", "x/", endpoint_url=s3_endpoint)
    with pytest.raises(StoreError):
        missing.put("k", b"v")


def test_the_registry_publishes_and_loads_a_chain_through_s3(s3, s3_endpoint: str, migrated_db_url: str) -> None:
    from flywheel.db.session import make_engine, make_session_factory

    settings = load_settings(None, store={"kind": "s3", "bucket": BUCKET, "prefix": "fleet/", "endpoint_url": s3_endpoint})
    store = make_store(settings)
    assert isinstance(store, S3Store)
    engine = make_engine(migrated_db_url)
    try:
        registry = Registry(make_session_factory(engine), store, "line-s3", full_every=4)
        rng = random.Random(5)
        states = [make_state(rng)]
        infos = [registry.publish(states[0], parent=None, train_step=0)]
        for v in range(1, 5):
            states.append(train_step(rng, states[-1]))
            infos.append(registry.publish(states[v], parent=v - 1, train_step=v))
        assert [i.kind for i in infos] == ["full", "delta", "delta", "delta", "full"]
        for info, state in zip(infos, states, strict=True):
            assert s3.head_object(Bucket=BUCKET, Key="fleet/" + info.store_key)["ContentLength"] == info.bytes
            assert_bit_exact(registry.load(info.version), state)

        # A delta damaged in the bucket is refused by its hash, never loaded as wrong weights.
        key = "fleet/" + infos[2].store_key
        body = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        body[-5] ^= 0xFF
        s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
        with pytest.raises(WeightsError):
            registry.load(infos[3].version)
    finally:
        engine.dispose()
