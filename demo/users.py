"""Simulated users of the simulated product: multi-turn sessions through the real HTTP API.

A user brings one task, reads the assistant's answer and reacts the way people do: a solved
task gets a thumbs-up now and then and an outcome event; a wrong answer gets a thumbs-down
sometimes, then either a retry in the same conversation or abandonment. Every reaction is sent
to ``/v1/feedback`` with a client-side ``feedback_id``, so a retried POST never double counts.

The behaviour (:func:`react`) is pure and seeded; :class:`UserPool` does the IO.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from demo.tinymodel.task import RETRY_MESSAGE, Problem, is_correct, traffic_problem, user_message

log = logging.getLogger("flywheel.simusers")


@dataclass(frozen=True)
class Behaviour:
    p_thumbs_up_when_right: float = 0.6
    p_thumbs_down_when_wrong: float = 0.4
    p_retry_when_wrong: float = 0.7
    max_attempts: int = 3
    #: A declared session-level boolean metric the user reports when the session ends: true when
    #: an answer solved the task, false when they give up (``flywheel demo --canary`` gates on it).
    success_metric: str | None = None


@dataclass(frozen=True)
class Reaction:
    """What the user does after one answer."""

    feedback: list[dict[str, Any]]
    retry: bool


def react(rng: random.Random, behaviour: Behaviour, correct: bool, attempt: int, generation_id: str) -> Reaction:
    """Pure: the feedback a user sends after answer number ``attempt`` (0-based) and whether they retry."""
    fb: list[dict[str, Any]] = []
    if correct:
        if rng.random() < behaviour.p_thumbs_up_when_right:
            fb.append({"generation_id": generation_id, "kind": "explicit", "signal": "thumbs", "value": 1})
        fb.append({"kind": "outcome", "signal": "task_solved", "value": 1})
        if behaviour.success_metric:
            fb.append({"metric": behaviour.success_metric, "value": True})
        return Reaction(fb, retry=False)
    if rng.random() < behaviour.p_thumbs_down_when_wrong:
        fb.append({"generation_id": generation_id, "kind": "explicit", "signal": "thumbs", "value": -1})
    if attempt + 1 < behaviour.max_attempts and rng.random() < behaviour.p_retry_when_wrong:
        fb.append({"generation_id": generation_id, "kind": "implicit", "signal": "retry"})
        return Reaction(fb, retry=True)
    fb.append({"generation_id": generation_id, "kind": "implicit", "signal": "abandon"})
    if behaviour.success_metric:
        fb.append({"metric": behaviour.success_metric, "value": False})
    return Reaction(fb, retry=False)


@dataclass
class Served:
    """One answer a user received."""

    t: float
    session_id: str
    generation_id: str
    version: int
    attempt: int
    correct: bool


@dataclass
class PoolStats:
    served: list[Served] = field(default_factory=list)
    sessions: int = 0
    solved_sessions: int = 0
    feedback_sent: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_error(self, what: str) -> None:
        with self.lock:
            self.errors[what] = self.errors.get(what, 0) + 1


class UserPool:
    """``users`` threads, each holding one session after another until ``stop`` is set."""

    def __init__(self, base_url: str, model: str, users: int, seed: int, behaviour: Behaviour = Behaviour(),
                 max_tokens: int = 32, api_key: str | None = None, t0: float | None = None,
                 sampling: dict[str, Any] | None = None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.users = users
        self.seed = seed
        self.behaviour = behaviour
        self.max_tokens = max_tokens
        #: The product's sampling settings, sent with every request (default: temperature 1).
        self.sampling = {"temperature": 1.0} if sampling is None else dict(sampling)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.stats = PoolStats()
        self.t0 = time.monotonic() if t0 is None else t0
        self._threads: list[threading.Thread] = []

    def start(self, stop: threading.Event) -> None:
        for i in range(self.users):
            t = threading.Thread(target=self._user, args=(i, stop), name=f"user-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def join(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _user(self, index: int, stop: threading.Event) -> None:
        rng = random.Random(self.seed * 100_003 + index)
        with httpx.Client(base_url=self.base_url, headers=self.headers, timeout=60.0) as client:
            while not stop.is_set():
                try:
                    self._session(client, rng, traffic_problem(rng), stop)
                except httpx.HTTPError as exc:
                    self.stats.add_error(type(exc).__name__)
                    log.warning("user %d: %s", index, exc)
                    stop.wait(0.5)

    def _session(self, client: httpx.Client, rng: random.Random, problem: Problem, stop: threading.Event) -> None:
        session_id = uuid.uuid4().hex
        messages: list[dict[str, str]] = [{"role": "user", "content": user_message(problem)}]
        with self.stats.lock:
            self.stats.sessions += 1
        for attempt in range(self.behaviour.max_attempts):
            if stop.is_set():
                return
            r = client.post(
                "/v1/chat/completions",
                json={"model": self.model, "messages": messages, "max_tokens": self.max_tokens, **self.sampling},
                headers={"X-Flywheel-Session": session_id},
            )
            if r.status_code != 200:
                self.stats.add_error(f"chat {r.status_code}")
                return
            body = r.json()
            text = body["choices"][0]["message"]["content"] or ""
            generation_id = r.headers["X-Flywheel-Generation"]
            version = int(r.headers["X-Flywheel-Model-Version"])
            correct = is_correct(problem, text)
            with self.stats.lock:
                self.stats.served.append(
                    Served(time.monotonic() - self.t0, session_id, generation_id, version, attempt, correct)
                )
                if correct:
                    self.stats.solved_sessions += 1
            reaction = react(rng, self.behaviour, correct, attempt, generation_id)
            self._send_feedback(client, session_id, reaction.feedback)
            if not reaction.retry:
                return
            messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": RETRY_MESSAGE}]

    def _send_feedback(self, client: httpx.Client, session_id: str, items: list[dict[str, Any]]) -> None:
        if not items:
            return
        batch = [dict(item, feedback_id=uuid.uuid4().hex, session_id=session_id) for item in items]
        for _ in range(3):  # a retried POST is safe: feedback ids make it idempotent
            r = client.post("/v1/feedback", json={"feedback": batch})
            if r.status_code == 202:
                with self.stats.lock:
                    self.stats.feedback_sent += len(batch)
                return
            self.stats.add_error(f"feedback {r.status_code}")
