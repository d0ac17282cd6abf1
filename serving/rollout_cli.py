"""``flywheel rollout promote V | rollback V | pin V | unpin | clear V | status``: the operator's command."""

from __future__ import annotations

import argparse
import json
from typing import Any

from flywheel.settings import Settings
from flywheel.weights.registry import VersionNotFound
from serving.rollout import open_line, status_report
from serving.rollout_actions import (
    RolloutError,
    announce,
    manual_clear,
    manual_pin,
    manual_promote,
    manual_rollback,
    manual_unpin,
)
from serving.rollout_calendar import summary


def operator() -> str:
    """Who runs this command, for the audit log: ``user@host``."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name (a container with an unnamed uid)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def other_lines_with(registry: Any, version: int) -> list[str]:
    """The other model lines of the registry's database that have ``version`` (for error messages)."""
    from sqlalchemy import select

    from flywheel.db.models import ModelVersion

    with registry.sessions() as db:
        query = select(ModelVersion.model_line).where(ModelVersion.version == version,
                                                      ModelVersion.model_line != registry.model_line)
        return sorted(db.scalars(query))


def main(args: argparse.Namespace, settings: Settings) -> int:
    """``flywheel rollout promote V | rollback V | pin V | unpin | clear V | status``.

    ``V`` is a version of ``model.line``, or ``LINE:V`` (refused unless LINE is ``model.line``).
    Exit status: 0 done; 1 refused (unknown version, another line's version, collected, weights that
    do not rebuild to their hash, a pinned line without ``--force``, unpin of an unpinned line, clear
    of a version that is not rolled back or fails its re-verification); 2 usage (no version named).
    """
    import sys

    def refuse(message: str, code: int = 1) -> int:
        print(f"flywheel rollout {args.action}: {message}", file=sys.stderr)
        return code

    db, sessions, registry = open_line(settings)
    try:
        if args.action == "status":
            report = status_report(registry, sessions, settings.rollout, metrics=settings.product_metrics())
            if args.json:
                print(json.dumps(report, indent=2, default=str))
                return 0
            print(f"model line {report['model_line']}")
            pin = report["pin"]
            if pin is not None:
                why = f": {pin['reason']}" if pin["reason"] else ""
                print(f"pinned to v{pin['version']} by {pin['by']} at {pin['at']}{why} "
                      f"(automatic rollout frozen; `flywheel rollout unpin` resumes it)")
            for v in report["versions"]:
                mark = " pinned" if pin is not None and pin["version"] == v["version"] else ""
                print(f"  v{v['version']:<6} {v['status']:<12} {v['kind']:<6} {v['created_at']}{mark}")
            d = report["next_decision"]
            target = f" v{d['version']}" if d["version"] is not None else ""
            print(f"next decision: {d['action']}{target}: {d['reason']}")
            for line in summary(report["calendar"]):
                print(f"calendar: {line}")
            return 0
        by = operator()
        if args.action == "unpin":
            if args.version is not None:
                return refuse("takes no version: a line has one pin (flywheel rollout unpin [--reason R])", 2)
            try:
                lifted = manual_unpin(registry, by, args.reason or "")
            except RolloutError as exc:
                return refuse(str(exc))
            print(f"unpinned {registry.model_line} (was pinned to {lifted.describe()}); automatic rollout resumes")
            return 0
        if args.version is None:
            return refuse(f"name the version (flywheel rollout {args.action} V)", 2)
        line, version = args.version if isinstance(args.version, tuple) else (None, args.version)
        if line is not None and line != registry.model_line:
            return refuse(f"v{version} of model line {line!r} is not this deployment's: model.line is "
                          f"{registry.model_line!r} (pins, promotions and rollbacks act on model.line only)")
        try:
            if args.action == "pin":
                _, changed = manual_pin(registry, version, by, args.reason or "")
            elif args.action == "clear":
                changed = manual_clear(registry, version, args.reason or "", force=args.force, by=by)
            else:
                act = manual_promote if args.action == "promote" else manual_rollback
                changed = act(registry, version, args.reason or "", force=args.force, by=by)
        except VersionNotFound:
            others = other_lines_with(registry, version)
            hint = (f" (model lines with a v{version}: {', '.join(others)}; this command acts on model.line)"
                    if others else "")
            return refuse(f"model line {registry.model_line!r} has no version {version}{hint}")
        except RolloutError as exc:
            return refuse(str(exc))
        announce(settings, [registry.get(v) for v in changed])
        for v in changed:
            print(f"v{v}: {registry.get(v).status}")
        if args.action == "clear":
            print(next(t["reason"] for t in reversed(registry.transitions(version))
                       if (t["from_status"], t["to_status"]) == ("rolled_back", "candidate")))
            stable = registry.latest("stable")
            if stable is not None and stable.version > version:
                print(f"v{version} is older than stable v{stable.version}: the controller will not canary it "
                      f"(`flywheel rollout promote v{version}` would)")
        held = registry.pinned()
        if held is not None:
            print(f"pinned to {held.describe()}; automatic rollout frozen until `flywheel rollout unpin`")
        return 0
    finally:
        db.dispose()
