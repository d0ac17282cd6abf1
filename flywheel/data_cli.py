"""``flywheel data export|forget|retain``: the command line of end users' data rights and retention.

- ``export --tenant T (--user U | --session S) [--out PATH]``: the subject's rows as JSON Lines
  (flywheel/subjects.py). ``--out`` is written mode ``0600`` under a temporary name beside PATH and
  renamed into place only when complete: a failed export leaves no partial file.
- ``forget --tenant T (--user U | --session S) [--by NAME]``: tombstone the subject, delete every
  row of theirs and print what was deleted and which model versions had been trained on their data
  (flywheel/erasure.py: weights are not unlearned). ``forget --resume`` completes what a crash left.

- ``retain [--dry-run] [--json]``: run the retention job once (flywheel/retention.py: each
  tenant's ``retention_days``), printing what was deleted (``--dry-run``: what would be) and the
  rate; the ``janitor`` role runs the same job every ``retention.interval_s``.

A user is named by the id exactly as the client sent it (OpenAI's ``user``, ``X-Flywheel-User``)
and hashed here with the gateway's secret (:func:`flywheel.subjects.deployment_secret`, which never
makes one); the raw id is never written.

Exit status: 0 done (an export or erasure of nothing is done too: the summary says 0 rows), 1 the
database, the secret or the output file failed, 2 bad arguments (a bad tenant, an empty user,
neither or both of ``--user`` and ``--session``).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.identity import SecretError
from flywheel.keys import check_tenant
from flywheel.subjects import (
    KINDS,
    MAX_SESSION_CHARS,
    Subject,
    count_shared,
    deployment_secret,
    export,
    summary,
    user_subject,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker


def add_data_commands(subparsers: Any) -> None:
    data = subparsers.add_parser("data", help="end users' data: export or erase one user's or one session's rows")
    sub = data.add_subparsers(dest="action", required=True)
    exp = sub.add_parser("export", help="write an end user's (or a session's) rows as JSON Lines: stdout, or --out")
    _subject_args(exp, required=True)
    exp.add_argument("--out", help="write the rows here (mode 0600) instead of stdout; '-' is stdout")
    forget = sub.add_parser("forget", help="erase an end user's (or a session's) rows, audited; --resume after a crash")
    _subject_args(forget, required=False)
    forget.add_argument("--by", help="who asks (the audit's requested_by; default: the login name)")
    forget.add_argument("--resume", action="store_true", help="complete the erasures a crash left pending")
    retain = sub.add_parser("retain", help="delete every tenant's rows older than its retention_days, in short batches")
    retain.add_argument("--dry-run", action="store_true", help="count the expired rows; delete nothing")
    retain.add_argument("--json", action="store_true", help="print the report as JSON")


def _subject_args(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--tenant", required=required, type=_tenant_arg, help="the tenant the user or session belongs to")
    who = parser.add_mutually_exclusive_group(required=required)
    who.add_argument("--user", type=_user_arg,
                     help="the end user's id exactly as the client sent it (OpenAI's user, X-Flywheel-User); "
                          "hashed with the gateway's secret, never written")
    who.add_argument("--session", type=_session_arg, help="a session id: its rows, whoever's they are")


def _tenant_arg(text: str) -> str:
    try:
        return check_tenant(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _user_arg(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("an empty user id names no one")
    return text


def _session_arg(text: str) -> str:
    if not text or len(text) > MAX_SESSION_CHARS or any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise argparse.ArgumentTypeError(f"a session id is 1 to {MAX_SESSION_CHARS} characters, no control characters")
    return text


def subject_of(args: argparse.Namespace, settings: Any, command: str) -> Subject | int:
    """The subject the arguments name, or the exit status of why there is none (module docstring)."""
    user, session_id = getattr(args, "user", None), getattr(args, "session", None)
    if (user is None) == (session_id is None) or user == "" or session_id == "":
        print(f"flywheel data {command}: name the subject with exactly one of --user and --session", file=sys.stderr)
        return 2
    try:
        tenant = check_tenant(args.tenant or "")
    except ValueError as exc:
        print(f"flywheel data {command}: {exc}", file=sys.stderr)
        return 2
    if user is None:
        return Subject(tenant, session_id=session_id)
    try:
        return user_subject(deployment_secret(settings.gateway.user_id_secret, settings.data_path), tenant, user)
    except SecretError as exc:
        print(f"flywheel data {command}: {exc}", file=sys.stderr)
        return 1


def main(args: argparse.Namespace, settings: Any) -> int:
    """``flywheel data ACTION``: the exit status (module docstring)."""
    if args.action == "retain":
        return _retain(settings, dry_run=args.dry_run, as_json=args.json)
    if args.action == "forget" and args.resume:
        if args.tenant or args.user or args.session:
            print("flywheel data forget: --resume takes no subject", file=sys.stderr)
            return 2
        subject: Subject | int | None = None
    else:
        subject = subject_of(args, settings, args.action)
        if isinstance(subject, int):
            return subject
    from flywheel.db.session import make_session_factory, open_database

    engine = open_database(settings.database_url, settings.db.wait_s)
    try:
        sessions = make_session_factory(engine)
        if args.action == "export":
            assert isinstance(subject, Subject)
            return _export(sessions, subject, args.out)
        if args.action == "forget":
            return _forget(sessions, subject, args.by or _login())
        raise AssertionError(f"unhandled data command {args.action}")
    finally:
        engine.dispose()


def _export(sessions: sessionmaker[Session], subject: Subject, out: str | None) -> int:
    path = None if out in (None, "-") else Path(out)
    if path is None:
        sys.stdout.flush()
        try:
            counts = export(sessions, subject, sys.stdout.buffer)
            sys.stdout.buffer.flush()
        except BrokenPipeError:  # the reader went away (`| head`): an incomplete export, no traceback
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing to flush at exit
            print("flywheel data export: stdout closed before the export was complete", file=sys.stderr)
            return 1
    else:
        try:
            counts = export_file(sessions, subject, path)
        except OSError as exc:
            print(f"flywheel data export: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
            return 1
    print(summary(subject, counts, "stdout" if path is None else str(path), count_shared(sessions, subject)),
          file=sys.stderr)
    return 0


def export_file(sessions: sessionmaker[Session], subject: Subject, path: Path) -> dict[str, int]:
    """Export to ``path``: mode 0600, written whole under a temporary name, then renamed into place."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            counts = export(sessions, subject, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
        return counts
    finally:
        temp.unlink(missing_ok=True)


def _forget(sessions: sessionmaker[Session], subject: Subject | None, by: str) -> int:
    from flywheel import erasure

    outcomes = (list(erasure.resume(sessions)) if subject is None
                else [erasure.complete(sessions, erasure.request(sessions, subject, by))])
    if subject is None and not outcomes:
        print("flywheel data forget: no erasure was pending", file=sys.stderr)
    for outcome in outcomes:
        print(json.dumps({"erasure": outcome.erasure_id, **outcome.subject.as_json(),
                          "requested_by": outcome.requested_by, "requested_at": outcome.requested_at.isoformat(),
                          "deleted": outcome.counts, "rows": sum(outcome.counts.values()),
                          "trained_into": outcome.trained_into}))
        trained = ", ".join(f"{v['model_line']} v{v['version']}" for v in outcome.trained_into) or "none"
        print(f"flywheel data forget: erasure {outcome.erasure_id}: {sum(outcome.counts.values())} rows deleted "
              f"({', '.join(f'{outcome.counts[k]} {k}' for k in KINDS)}); versions trained on this data: {trained} "
              "(weights are not unlearned; nothing of it stored here is trained on again)", file=sys.stderr)
    return 0


def _retain(settings: Any, *, dry_run: bool, as_json: bool) -> int:
    from flywheel.db.session import make_session_factory, open_database
    from flywheel.retention import run_once

    engine = open_database(settings.database_url, settings.db.wait_s)
    try:
        report = run_once(settings.tenants, make_session_factory(engine), batch=settings.retention.batch,
                          rest=settings.retention.rest, dry_run=dry_run)
    finally:
        engine.dispose()
    if as_json:
        print(json.dumps(report.as_json()))
    else:
        verb = "would delete" if dry_run else "deleted"
        print(f"flywheel data retain: {verb} {report.rows} rows "
              f"({', '.join(f'{n} {t}' for t, n in report.deleted.items())}) in {report.seconds:.1f} s "
              f"({report.rows_per_s:.0f} rows/s)")
    return 0


def _login() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name (a container with an unnamed uid)
        return "operator"
