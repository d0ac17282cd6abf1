"""The ``forget_under_faults`` scenario's fault: an end user erased mid-session while the broker is away and workers are killed.

A simulated end user of its own (:data:`SUBJECT`, on the first tenant, named by OpenAI's ``user``)
is driven by the fault itself, so what it sent before and after the request is known exactly:

1. a few sessions of two turns with feedback, ended by an outcome (closed, scored and, given the
   time, trained into a version: the erasure's ``trained_into`` must then name it);
2. one turn of a live session, left open; then the broker goes away (:func:`chaos.faults.broker_away`)
   and the live session gets a second turn (spooled by the gateway);
3. ``flywheel data forget --tenant T --user SUBJECT`` runs as its own process against the fleet's
   settings; once its ``erasures`` row is written, ingest-1 is killed (-9), the live session gets a
   turn after the request (the session rule must drop it), and the forget process is killed (-9)
   mid-deletion: its request must be left ``pending``;
4. the broker resumes; ``flywheel data forget --resume`` completes it while rewards-1 and the
   trainer are killed (-9) and restarted and the live session gets one more turn;
5. after completion: a last turn of the live session (dropped) and a new session of the same user,
   which is new data and must be kept.

Each kill and the erasure's states are :meth:`Chaos.expect` ations; the subject
(:class:`chaos.forgotten.ForgetSubject`) is checked after the run by ``forgotten_leave_no_trace``.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from chaos.faults import Chaos, broker_away, expect_spooling
from chaos.forgotten import ForgetSubject
from flywheel.events import trajectory_id_for
from testbed.procs import wait_for

#: The erased end user's id, as its client sends it.
SUBJECT = "chaos-forget-subject"


class Subject:
    """The erased end user's client: its sessions, turns and feedback through :class:`chaos.users.Users`."""

    def __init__(self, c: Chaos, client: httpx.Client, rng: random.Random) -> None:
        self.c, self.client, self.rng = c, client, rng
        self.messages: dict[str, list[dict[str, str]]] = {}

    def open(self) -> str:
        from demo.tinymodel.task import traffic_problem, user_message

        session_id = uuid.uuid4().hex
        with self.c.users.log.lock:
            self.c.users.log.sessions.add(session_id)
        self.messages[session_id] = [{"role": "user", "content": user_message(traffic_problem(self.rng))}]
        return session_id

    def turn(self, session_id: str, end: bool = False) -> bool:
        """One completion and its feedback (``end``: with an outcome, which closes the session);
        whether the answer was received."""
        from demo.tinymodel.task import RETRY_MESSAGE

        messages = self.messages[session_id]
        got = self.c.users.chat(self.client, session_id, messages, stream=self.rng.random() < 1 / 3, user=SUBJECT)
        items: list[dict[str, Any]] = []
        if got is not None:
            text, generation_id = got
            items.append({"generation_id": generation_id, "kind": "explicit", "signal": "thumbs",
                          "value": self.rng.choice((1, -1))})
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": RETRY_MESSAGE}]
        if end:
            items.append({"kind": "outcome", "signal": "task_solved", "value": 1})
        self.c.users.feedback(self.client, session_id, items)
        return got is not None

    def session(self, turns: int = 2) -> bool:
        session_id = self.open()
        served = [self.turn(session_id, end=i == turns - 1) for i in range(turns)]
        return any(served)


def _forget(c: Chaos, *args: str) -> subprocess.Popen[bytes]:
    """``flywheel data forget ARGS`` with ingest-1's settings (the fleet's database and data_dir, so
    the gateway's user-id secret), logged beside the roles'."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    log = open(c.fleet.log_dir / "forget.log", "ab")  # noqa: SIM115 (the child holds it)
    log.write(f"=== chaos: flywheel data forget {' '.join(args)}\n".encode())
    log.flush()
    try:
        return subprocess.Popen([sys.executable, "-m", "launch.cli", "--config", str(c.fleet.procs["ingest-1"].config),
                                 "data", "forget", *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    finally:
        log.close()


def _erasure(engine: Any, tenant: str, user_hash: str) -> tuple[int, str, dict[str, int]] | None:
    """The subject's erasure: (id, state, counts), or None before its row is written."""
    from sqlalchemy import select

    from flywheel.db.models import Erasure

    with engine.connect() as conn:
        row = conn.execute(select(Erasure.id, Erasure.state, Erasure.counts)
                           .where(Erasure.tenant == tenant, Erasure.user_hash == user_hash)
                           .order_by(Erasure.id.desc()).limit(1)).first()
    return None if row is None else (int(row[0]), str(row[1]), dict(row[2] or {}))


def _trained(engine: Any, tenant: str, sessions: list[str]) -> list[int]:
    """The versions the subject's sessions were trained into so far."""
    from sqlalchemy import select

    from flywheel.db.models import TrainedTrajectory

    ids = [trajectory_id_for(tenant, sid) for sid in sessions]
    with engine.connect() as conn:
        return sorted({int(v) for v in conn.scalars(select(TrainedTrajectory.version)
                                                  .where(TrainedTrajectory.trajectory_id.in_(ids)))})


def _kill(c: Chaos, name: str) -> None:
    c.fleet.kill(name)
    c.note(f"kill -9 {name}")


def fault_forget(c: Chaos) -> None:
    """The scenario's fault (module docstring). Once the forget is requested it runs to the end
    even past the traffic window: an erasure is completed, never abandoned."""
    from flywheel.db.session import make_engine
    from flywheel.subjects import deployment_secret, user_subject

    assert c.fleet.keys is not None, "forget_under_faults runs with gateway.auth on"
    tenant, key = c.fleet.keys.tenants[0]
    base = c.fleet.base
    if not c.at(0.05):
        return
    user_hash = user_subject(deployment_secret(base.gateway.user_id_secret, base.data_path), tenant, SUBJECT).user_hash
    assert user_hash is not None
    engine = make_engine(base.database_url)
    before: list[str] = []
    after: list[str] = []
    try:
        with httpx.Client(base_url=c.fleet.gateway_url, timeout=30.0,
                          headers={"Authorization": f"Bearer {key}"}) as client:
            subject = Subject(c, client, random.Random(c.rng.random()))
            for _ in range(3):
                session_id = subject.open()
                if any([subject.turn(session_id), subject.turn(session_id, end=True)]):
                    before.append(session_id)
            c.note(f"{SUBJECT} ({tenant}) served in {len(before)} session(s)")
            trained: list[int] = []
            while not trained and c.at(0.1) and time.monotonic() < c.t0 + 0.45 * c.seconds:
                trained = _trained(engine, tenant, before)
                c.sleep(0.5)
            c.note(f"its sessions trained into {[f'v{v}' for v in trained] or 'no version yet'}")
            live = subject.open()
            if subject.turn(live):
                before.append(live)
            time.sleep(1.5)  # ingest stores it: the request finds the session (else ingest covers it later)
            with broker_away(c):
                time.sleep(3.0)  # the gateway notices (gateway.ship_timeout_s) and spools
                subject.turn(live)  # spooled; sent before the request
                expect_spooling(c, 3.0)
                first = _forget(c, "--tenant", tenant, "--user", SUBJECT, "--by", "chaos")
                try:
                    erasure = wait_for("the erasure's row", lambda: _erasure(engine, tenant, user_hash), 60.0, 0.05)
                except TimeoutError:
                    first.kill()
                    c.expect("forget writes its tombstone", False, "no erasures row within 60 s (forget.log)")
                    return
                c.note(f"erasure {erasure[0]} requested (forget pid {first.pid}) while the broker is away")
                _kill(c, "ingest-1")
                time.sleep(0.4)
                first.kill()
                rc = first.wait(30)
                state = _erasure(engine, tenant, user_hash)
                c.note(f"kill -9 forget mid-deletion (exit {rc}): erasure {state}")
                c.expect("forget killed mid-deletion leaves its request pending",
                         rc == -9 and state is not None and state[1] == "pending", f"exit {rc}, erasure {state}")
                subject.turn(live)  # after the request: the session rule drops it
                c.fleet.restart("ingest-1")
                time.sleep(3.0)
            resume = _forget(c, "--resume")
            time.sleep(1.0)
            for name in ("rewards-1", "trainer"):
                _kill(c, name)
            subject.turn(live)
            time.sleep(1.0)
            for name in ("rewards-1", "trainer"):
                c.fleet.restart(name)
            try:
                rc = resume.wait(120)
            except subprocess.TimeoutExpired:
                resume.kill()
                rc = None
            state = _erasure(engine, tenant, user_hash)
            c.note(f"forget --resume exit {rc}: erasure {state}")
            c.expect("forget --resume completes the request", rc == 0 and state is not None and state[1] == "done"
                     and sum(state[2].values()) > 0, f"exit {rc}, erasure {state} ({Path(c.fleet.log_dir, 'forget.log')})")
            subject.turn(live, end=True)  # after completion: dropped too
            fresh = subject.open()
            if any([subject.turn(fresh), subject.turn(fresh, end=True)]):
                after.append(fresh)
            c.note(f"{SUBJECT}: {len(before)} session(s) before the request, 1 turn after it in the live one, "
                   f"{len(after)} new session(s) after completion")
    finally:
        c.subjects.append(ForgetSubject(tenant, user_hash, tuple(before), tuple(after)))
        engine.dispose()
