"""Simulated users over HTTP, and the client's log the invariants are checked against.

Each user holds one session after another (the reactions of :func:`demo.users.react`), a
third of the completions streamed, each user sending its own API key when the gateway runs with
auth on and naming its end user (OpenAI's ``user``: ``chaos-user-<i>``, :meth:`Users.end_user`), as a
product names the person behind a request. A response counts as received when it is a 200 with its
generation header (a stream: once ``data: [DONE]`` arrived); feedback is retried until the gateway
accepts it (202), its ids making retries safe. Everything else is a :class:`Failure`.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("flywheel.chaos")

SESSION_HEADER = "X-Flywheel-Session"
GENERATION_HEADER = "X-Flywheel-Generation"
VERSION_HEADER = "X-Flywheel-Model-Version"


@dataclass(frozen=True)
class Received:
    """A response a client received whole (a stream: up to ``data: [DONE]``)."""

    session_id: str
    generation_id: str
    version: int
    stream: bool


@dataclass(frozen=True)
class Failure:
    """A request that did not end in a received response. ``kind``: ``connection`` (no answer: a
    refused or broken connection, a timeout), ``status`` (an HTTP error), ``stream`` (a stream
    that ended in an error event or without ``[DONE]``)."""

    session_id: str
    kind: str
    status: int | None
    code: str


@dataclass
class ClientLog:
    received: dict[str, Received] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    feedback: dict[str, str] = field(default_factory=dict)  # accepted feedback_id -> session_id
    feedback_refused: Counter[str] = field(default_factory=Counter)
    sessions: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def errors(self) -> dict[str, int]:
        out = Counter(f"{f.kind} {f.status or ''} {f.code}".replace("  ", " ").strip() for f in self.failures)
        out.update({f"feedback refused {k}": v for k, v in self.feedback_refused.items()})
        return dict(out.most_common())


class Users:
    """``n`` simulated users, each holding one session after another until stopped (the reactions
    of :func:`demo.users.react`; a third of requests streamed; ``think_s`` between calls)."""

    def __init__(self, gateway: str, model_line: str, n: int, seed: int, max_tokens: int = 16,
                 think_s: tuple[float, float] = (0.1, 0.5), timeout_s: float = 30.0,
                 keys: tuple[str, ...] = ()) -> None:
        self.gateway, self.model_line, self.n, self.seed = gateway, model_line, n, seed
        self.keys = keys  # API keys, user i sends keys[i % len(keys)] (none: the gateway runs without auth)
        self.max_tokens, self.think_s, self.timeout_s = max_tokens, think_s, timeout_s
        self.log = ClientLog()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self.n):
            t = threading.Thread(target=self._user, args=(i,), name=f"chaos-user-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout_s: float = 90.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.1, deadline - time.monotonic()))

    @staticmethod
    def end_user(index: int) -> str:
        """The end-user id simulated user ``index`` sends (stable across its sessions)."""
        return f"chaos-user-{index}"

    def _user(self, index: int) -> None:
        rng = random.Random(self.seed * 100_003 + index)
        headers = {"Authorization": f"Bearer {self.keys[index % len(self.keys)]}"} if self.keys else {}
        with httpx.Client(base_url=self.gateway, timeout=self.timeout_s, headers=headers) as client:
            while not self._stop.is_set():
                try:
                    self._session(client, rng, self.end_user(index))
                except Exception as exc:  # never let a user thread die: that would stop the traffic
                    log.warning("chaos user %d: %s: %s", index, type(exc).__name__, exc)
                    self._stop.wait(0.5)

    def _fail(self, session_id: str, kind: str, status: int | None, code: str) -> None:
        with self.log.lock:
            self.log.failures.append(Failure(session_id, kind, status, code))

    def _session(self, client: httpx.Client, rng: random.Random, user: str) -> None:
        from demo.tinymodel.task import RETRY_MESSAGE, is_correct, traffic_problem, user_message
        from demo.users import Behaviour, react

        behaviour = Behaviour()
        problem = traffic_problem(rng)
        session_id = uuid.uuid4().hex
        with self.log.lock:
            self.log.sessions.add(session_id)
        messages = [{"role": "user", "content": user_message(problem)}]
        for attempt in range(behaviour.max_attempts):
            if self._stop.is_set():
                return
            got = self.chat(client, session_id, messages, stream=rng.random() < 1 / 3, user=user)
            if got is None:
                self._stop.wait(0.3)
                return
            text, generation_id = got
            reaction = react(rng, behaviour, is_correct(problem, text), attempt, generation_id)
            self.feedback(client, session_id, reaction.feedback)
            self._stop.wait(rng.uniform(*self.think_s))
            if not reaction.retry:
                return
            messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": RETRY_MESSAGE}]

    def chat(self, client: httpx.Client, session_id: str, messages: list[dict[str, str]],
             stream: bool, user: str | None = None) -> tuple[str, str] | None:
        """One completion in ``session_id`` for end user ``user`` (OpenAI's ``user``; None names no
        one): (its text, its generation id) once received, else None (a :class:`Failure` logged)."""
        body: dict[str, Any] = {"model": self.model_line, "messages": messages, "max_tokens": self.max_tokens,
                                "temperature": 1.0, "stream": stream}
        if user is not None:
            body["user"] = user
        headers = {SESSION_HEADER: session_id}
        try:
            if not stream:
                r = client.post("/v1/chat/completions", json=body, headers=headers)
                if r.status_code != 200:
                    self._fail(session_id, "status", r.status_code, _error_code(r.content))
                    return None
                text = r.json()["choices"][0]["message"]["content"] or ""
                generation_id, version = r.headers[GENERATION_HEADER], int(r.headers[VERSION_HEADER])
            else:
                with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                    if r.status_code != 200:
                        self._fail(session_id, "status", r.status_code, _error_code(r.read()))
                        return None
                    generation_id, version = r.headers[GENERATION_HEADER], int(r.headers[VERSION_HEADER])
                    parts: list[str] = []
                    done = False
                    for line in r.iter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True
                            break
                        chunk = json.loads(data)
                        if chunk.get("error") is not None:
                            self._fail(session_id, "stream", 200, str(chunk["error"].get("code")))
                            return None
                        for choice in chunk.get("choices") or []:
                            parts.append((choice.get("delta") or {}).get("content") or "")
                    if not done:
                        self._fail(session_id, "stream", 200, "no [DONE]")
                        return None
                    text = "".join(parts)
        except httpx.HTTPError as exc:
            self._fail(session_id, "connection", None, type(exc).__name__)
            return None
        with self.log.lock:
            self.log.received[generation_id] = Received(session_id, generation_id, version, stream)
        return text, generation_id

    def feedback(self, client: httpx.Client, session_id: str,
                 items: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """POST until accepted (202); a retried batch is safe (feedback ids are idempotency keys).
        Returns the items as accepted (with their ``feedback_id`` and ``session_id``), else None."""
        if not items:
            return None
        batch = [dict(item, feedback_id=uuid.uuid4().hex, session_id=session_id) for item in items]
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            try:
                r = client.post("/v1/feedback", json={"feedback": batch})
            except httpx.HTTPError:
                time.sleep(0.5)
                continue
            if r.status_code == 202:
                with self.log.lock:
                    self.log.feedback.update({item["feedback_id"]: session_id for item in batch})
                return batch
            if r.status_code < 500 and r.status_code != 429:
                with self.log.lock:
                    self.log.feedback_refused[f"{r.status_code} {_error_code(r.content)}"] += 1
                return None
            time.sleep(0.5)
        with self.log.lock:
            self.log.feedback_refused["gave up after 60 s"] += 1
        return None


def _error_code(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"].get("code") or "")
    except (ValueError, KeyError, TypeError, AttributeError):
        return ""
