"""The pure parts of tests/integration/test_http_hygiene.py's fixes: flywheel/private.py (the umask and
the data folder's mode, on real folders) and the message of the 400 for a request uvicorn's parsers
refuse (serving/server.py), built from the parsers' own errors."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import h11
import httptools
import pytest

from flywheel.private import DIR_MODE, UMASK, chmod_refusal, make_private, private_umask
from serving.server import malformed_message

pytestmark = pytest.mark.unit


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The umask most shells start processes with, restored afterwards."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_chmod_refusal_names_why_a_folder_is_not_ours_to_change() -> None:
    me, other = 1000, 0
    assert chmod_refusal(stat.S_IFDIR | 0o755, me, me) is None
    assert chmod_refusal(stat.S_IFDIR | 0o700, me, me) is None
    assert chmod_refusal(stat.S_IFREG | 0o644, me, me) == "it is not a directory"
    assert chmod_refusal(stat.S_IFDIR | 0o755, other, me) == "it belongs to uid 0, not to this user (uid 1000)"
    assert "sticky" in (chmod_refusal(stat.S_IFDIR | stat.S_ISVTX | 0o777, me, me) or "")  # /tmp


def test_private_umask_makes_new_files_and_folders_the_owners_alone(tmp_path: Path, umask_022: None) -> None:
    assert private_umask() == 0o022
    assert os.umask(UMASK) == UMASK
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    fd = os.open(tmp_path / "explicit", os.O_CREAT | os.O_WRONLY, 0o644)  # as the bus log opens its files
    os.close(fd)
    assert [_mode(tmp_path / n) for n in ("dir", "file", "explicit")] == [0o700, 0o600, 0o600]


def test_make_private_tightens_creates_and_never_loosens(tmp_path: Path, umask_022: None) -> None:
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    assert _mode(old) == 0o755
    assert make_private(old) is True and _mode(old) == DIR_MODE

    missing = tmp_path / "missing" / "data"
    assert make_private(missing) is False and not missing.exists()  # only created when asked
    assert make_private(missing, create=True) is True and _mode(missing) == DIR_MODE

    stricter = tmp_path / "stricter"
    stricter.mkdir()
    stricter.chmod(0o500)
    try:
        assert make_private(stricter) is True and _mode(stricter) == 0o500  # private already: left alone
    finally:
        stricter.chmod(0o700)


def test_make_private_leaves_shared_folders_and_files_alone_and_says_so(tmp_path: Path, umask_022: None,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: chmod-ing it would lock every other user out
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with caplog.at_level(logging.WARNING, logger="flywheel.private"):
        assert make_private(shared) is False
        assert make_private(a_file) is False
    assert _mode(shared) == 0o1777 and _mode(a_file) == 0o644
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("chmod 700" in w for w in warnings), warnings
    assert "sticky" in warnings[0] and "not a directory" in warnings[1]


def _httptools_error(data: bytes) -> BaseException:
    parser = httptools.HttpRequestParser(object())
    with pytest.raises(httptools.HttpParserError) as caught:
        parser.feed_data(data)
    return caught.value


def _h11_error(data: bytes) -> BaseException:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    with pytest.raises(h11.RemoteProtocolError) as caught:
        while conn.next_event() not in (h11.NEED_DATA, h11.PAUSED):
            pass
    return caught.value


@pytest.mark.parametrize(("request_bytes", "reason"), [
    (b"GET / HTTP/1.1\r\nX-A: a\x00b\r\n\r\n", "Invalid header value char"),
    (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", "Invalid character in Content-Length"),
    (b"POST / HTTP/1.1\r\nContent-Length: 18446744073709551616\r\n\r\n", "Content-Length overflow"),
    (b"POST / HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
     "Transfer-Encoding can't be present with Content-Length"),
])
def test_malformed_message_carries_the_httptools_reason(request_bytes: bytes, reason: str) -> None:
    assert malformed_message(_httptools_error(request_bytes)) == f"malformed HTTP request: {reason}"


def test_malformed_message_never_reflects_the_request() -> None:
    marker = os.urandom(8).hex()
    for data in (b"GET / HTTP/1.1\r\nHost: x\r\nX-Secret: " + marker.encode() + b"\x00\r\n\r\n",
                 b"GET /" + marker.encode() + b"\xff HTTP/1.1\r\nHost: x\r\n\r\n",
                 marker.encode() + b"\r\n\r\n"):
        message = malformed_message(_h11_error(data))
        assert message.startswith("malformed HTTP request: ") and len(message) > len("malformed HTTP request: ")
        assert marker not in message and "bytearray" not in message, message
    callback = httptools.HttpParserCallbackError("User callback error")
    assert malformed_message(callback) == "malformed HTTP request: the request line or headers cannot be decoded"
    assert malformed_message(None) == "malformed HTTP request"
    odd = malformed_message(ValueError("\x00\u202e" + "a" * 500))
    assert odd.isascii() and odd.isprintable() and len(odd) <= len("malformed HTTP request: ") + 200
