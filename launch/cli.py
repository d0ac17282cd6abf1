"""The ``flywheel`` console script: parse and validate settings first, then import the role.

Every role is a thin entry point ``run(settings, stop)`` in its stage package. The CLI is the
composition root: it names those entry points, and every other command that is not kernel (a
role's one-shot actions, ``demo``, ``chaos``), by string in :data:`ROLES` and :data:`COMMANDS`,
and imports one only when asked. So no kernel module imports a stage or an application, and torch
is not imported before the settings are known to be valid. A role that loads the model
(:data:`MODEL_ROLES`) is started with ``model.path`` filled: the given one, else the demo's tiny
model (:func:`launch.up.with_model`).

A process started with ``--parent-pid PID`` (``flywheel up``'s children) dies with that parent,
however the parent ends (:func:`die_with_parent`), before anything else happens in it.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from flywheel.health import ROLES as HEALTH_ROLES
from flywheel.private import make_private, private_umask
from flywheel.settings import Settings, SettingsError, load_settings

#: role -> "module:function" taking (settings, stop)
ROLES: dict[str, str] = {
    "gateway": "serving.gateway.main:run",
    "node": "serving.node.main:run",
    "rollout": "serving.rollout:run",
    "ingest": "ingest.worker:run",
    "rewards": "rewards.worker:run",
    "trainer": "trainer.train:train",
    "janitor": "flywheel.janitor:run",
}

#: roles that load the model: started with ``model.path`` filled (the stages refuse an empty one)
MODEL_ROLES = ("node", "trainer")

#: command -> "module:function" taking (args, settings) and returning the exit status: a role's
#: one-shot actions (``flywheel rollout ACTION``, ``flywheel rewards ACTION``), ``flywheel data
#: ACTION`` (end users' data, flywheel/data_cli.py) and the applications
COMMANDS: dict[str, str] = {
    "rollout": "serving.rollout_cli:main",
    "rewards": "rewards.rescore:main",
    "data": "flywheel.data_cli:main",
    "demo": "demo.run:main",
    "chaos": "chaos.run:main",
}

ROLE_HELP = {
    "gateway": "OpenAI-compatible gateway that captures generations and feedback",
    "node": "built-in inference node (tiny model or any local HF model) with its weight updater",
    "rollout": "rollout controller: gates candidates, runs canaries, promotes or rolls back on a schedule",
    "ingest": "assemble sessions into trajectories, persist raw events",
    "rewards": "score trajectories with the reward spec",
    "trainer": "continuous async policy-gradient trainer that publishes versions",
    "janitor": "periodic housekeeping: retention, the local bus's expired segments, stale erasures, the erasure sweep",
}


def resolve(target: str) -> Callable[..., Any]:
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM/SIGINT, so every role shuts down the same way."""
    stop = threading.Event()

    def _handler(signum: int, _frame: Any) -> None:
        logging.getLogger("flywheel").info("received signal %s, stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    return stop


#: prctl(2)'s option that has the kernel signal this process when its parent thread exits.
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """End this process when the parent ``parent_pid`` ends, however it ends (``kill -9``
    included). On Linux the kernel sends SIGKILL when the thread that forked this process exits
    (``prctl(PR_SET_PDEATHSIG)``); elsewhere a daemon thread watches the parent. A kill is what
    every role is built to survive (nothing accepted is lost), and a role whose supervisor is gone
    must not linger. If the parent is gone already (it died before the call), exit at once."""
    armed = False
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if os.getppid() != parent_pid:  # the parent died before the signal was armed: no signal comes
        os._exit(1)
    if armed:
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if getattr(args, "data_dir", None):
        out["data_dir"] = args.data_dir
    role = getattr(args, "command", None)
    if getattr(args, "port", None) is not None and role in ("gateway", "node", "up"):
        out.setdefault("gateway" if role in ("gateway", "up") else "node", {})["port"] = args.port
    if getattr(args, "upstream", None):
        out.setdefault("gateway", {})["upstream"] = args.upstream
    return out


def _version_ref(text: str) -> int | tuple[str, int]:
    """``flywheel rollout``'s VERSION: ``3`` or ``v3`` (of model.line), or ``LINE:3`` (a line named
    explicitly; serving/rollout_cli.py refuses another line than model.line)."""
    line, sep, number = text.rpartition(":")
    digits = number[1:] if number[:1] in ("v", "V") else number
    if not (digits.isascii() and digits.isdigit()) or int(digits) >= 2**31 or (sep and not line):
        raise argparse.ArgumentTypeError(f"invalid version {text!r}: expected V, vV or LINE:V with V a whole number")
    return (line, int(digits)) if line else int(digits)


def _text_arg(text: str) -> str:
    """A free-text argument that is stored or matched in the database: at most 1000 characters and
    no control characters (PostgreSQL refuses NUL in text; the others only garble logs)."""
    if len(text) > 1000:
        raise argparse.ArgumentTypeError("longer than 1000 characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise argparse.ArgumentTypeError(f"control characters are not allowed: {text[:80]!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flywheel", description="RL from live product feedback.")
    parser.add_argument("--config", help="settings file (TOML or JSON); also FLYWHEEL_CONFIG")
    parser.add_argument("--data-dir", help="where embedded state lives (default .flywheel)")
    # flywheel up's children: die with the process that started them (die_with_parent)
    parser.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("schema", help="print the JSON Schemas of the wire contracts")
    sub.add_parser("settings", help="print the effective settings as JSON")
    health = sub.add_parser("health", help="exit 0 if ROLE's main loop beat on this host lately, else 1 with the reason "
                                           "(the container health check; flywheel/health.py)")
    health.add_argument("role", choices=HEALTH_ROLES)
    health.add_argument("--max-age-s", type=float, default=60.0,
                        help="the loop's longest legitimate pause: an older heartbeat is unhealthy (default 60)")
    db = sub.add_parser("db", help="database administration")
    db.add_argument("action", choices=["upgrade"])

    for role, helptext in ROLE_HELP.items():
        p = sub.add_parser(role, help=helptext)
        if role in ("gateway", "node"):
            p.add_argument("--port", type=int)
        if role == "gateway":
            p.add_argument("--upstream", help="OpenAI-compatible base URL to front (default: the local node)")
        if role == "rollout":  # no action: the controller loop; serving/rollout_cli.py does the others
            p.add_argument("action", nargs="?", choices=["promote", "rollback", "pin", "unpin", "clear", "status"],
                           help="promote V: make V stable; rollback V: roll back a canary, or the stable version "
                                "(restores the newest earlier stable one); pin V: make V stable and freeze "
                                "automatic rollout (ends a running canary); unpin: resume it; clear V: re-verify "
                                "a rolled-back version end to end and make it a candidate again; status: versions, "
                                "the pin and the next decision")
            p.add_argument("version", nargs="?", type=_version_ref,
                           help="promote / rollback / pin / clear: the version of model.line (V, vV or LINE:V)")
            p.add_argument("--reason", type=_text_arg,
                           help="promote / rollback / pin / unpin / clear: added to the audited reason")
            p.add_argument("--force", action="store_true",
                           help="promote / rollback / clear on a pinned line: do it anyway (a promote or rollback "
                                "moves the pin to the new stable version; a clear leaves it)")
            p.add_argument("--json", action="store_true", help="status: print JSON")
        if role == "rewards":  # no action: the worker; rewards/rescore.py does the other two
            p.add_argument("action", nargs="?", choices=["rescore", "report"],
                           help="rescore: rebuild scores from stored trajectories under --spec (no bus); "
                                "report: per-version training/held-out reward rates and anomaly flags")
            p.add_argument("--spec", help="rescore: the reward spec TOML to score with")
            p.add_argument("--spec-version", type=_text_arg, help="report: only this spec version")
            p.add_argument("--json", action="store_true", help="report: print JSON")

    up = sub.add_parser("up", help="run every role on this machine (embedded defaults)")
    up.add_argument("--port", type=int, help="gateway port (default 8000)")

    demo = sub.add_parser("demo", help="`up` plus simulated users; prints progress and a summary")
    demo.add_argument("--quick", action="store_true", help="a short run (< 5 minutes)")
    demo.add_argument("--minutes", type=float, help="length of the simulated traffic")
    demo.add_argument("--lr", type=float, help="trainer learning rate (0 gives the control run)")
    demo.add_argument("--users", type=int, help="concurrent simulated users")
    demo.add_argument("--json", dest="json_path", help="write the summary JSON here")
    demo.add_argument("--plot", dest="plot_path", help="write the reward-over-time PNG here")
    demo.add_argument("--port", type=int, help="gateway port (default: a free one)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--canary", action="store_true",
                      help="promote through a canary that must win on the users' success metric (demo/run.py DEMO_CANARY)")
    demo.add_argument("--temperature", type=float, help="the users' (and held-out evaluation's) sampling temperature")
    demo.add_argument("--top-p", type=float, help="the users' (and held-out evaluation's) top-p")
    demo.add_argument("--top-k", type=int, help="the users' (and held-out evaluation's) top-k")

    chaos = sub.add_parser("chaos", help="run the whole stack under injected faults and check its invariants "
                                         "(private PostgreSQL, Redis and Kafka-protocol broker; docs/chaos.md)")
    chaos.add_argument("--scenario", "-s", action="append", metavar="NAME[,NAME]",
                       help="scenarios to run (repeatable; default: all; --list names them)")
    chaos.add_argument("--list", action="store_true", help="list the scenarios and exit")
    chaos.add_argument("--quick", action="store_true", help="the quick subset, 20 s of traffic each")
    chaos.add_argument("--seconds", type=float,
                       help="traffic (and fault) window per scenario (default 30; bad_delta takes at least 45)")
    chaos.add_argument("--users", type=int, default=6, help="concurrent simulated users")
    chaos.add_argument("--seed", type=int, default=0)
    chaos.add_argument("--json", dest="json_path", help="write the results as JSON here")
    chaos.add_argument("--keep", action="store_true", help="keep the run folder (logs, configs) afterwards")

    model = sub.add_parser("model", help="the demo's tiny model (the default when model.path is empty)")
    model.add_argument("action", choices=["build"])
    model.add_argument("--quick", action="store_true")

    from flywheel.weights.cli import add_weights_commands

    add_weights_commands(sub)
    from flywheel.keys import add_keys_commands

    add_keys_commands(sub)
    from flywheel.data_cli import add_data_commands

    add_data_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The entry point of every flywheel process (the console script, ``python -m launch.cli``,
    ``flywheel up``'s children): everything it creates is its owner's alone (flywheel/private.py)."""
    private_umask()  # first, before anything is created
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    try:
        settings = load_settings(args.config, **_overrides(args))
    except SettingsError as exc:
        print(f"flywheel: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    for chatty in ("httpx", "httpcore", "alembic", "kafka"):  # one line per request or per plugin
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))
    make_private(settings.data_path)  # an existing data_dir; a new one is made under the umask
    from flywheel.db.session import DatabaseUnavailable

    try:
        return dispatch(args, settings)
    except DatabaseUnavailable as exc:  # its message names the database without its password
        print(f"flywheel: {exc}", file=sys.stderr)
        return 1


def dispatch(args: argparse.Namespace, settings: Settings) -> int:
    command = args.command
    if command == "schema":
        from flywheel.events import schemas_json

        print(schemas_json())
        return 0
    if command == "settings":
        from flywheel.settings import redacted

        print(json.dumps(redacted(settings), indent=2))  # passwords and keys as *** (docs/security.md)
        return 0
    if command == "db":
        from flywheel.db.session import safe_url, upgrade, wait_for_db

        wait_for_db(settings.database_url, settings.db.wait_s)
        upgrade(settings.database_url)
        print(f"database at head: {safe_url(settings.database_url)}")
        return 0
    if command == "health":
        from flywheel.health import check

        ok, message = check(settings, args.role, args.max_age_s)
        print(message if ok else f"flywheel health: {message}", file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    if command == "model":
        from launch.up import default_model

        print(default_model(settings.data_path / "models", quick=args.quick))
        return 0
    if command in COMMANDS and (command not in ROLES or args.action):
        return resolve(COMMANDS[command])(args, settings)
    if command in ROLES:
        if command in MODEL_ROLES:
            from launch.up import with_model

            settings = with_model(settings)
        resolve(ROLES[command])(settings, stop_on_signals())
        return 0
    if command == "up":
        from launch.up import up

        return up(settings, stop_on_signals())
    if command == "weights":
        return args.weights_func(args, settings)
    if command == "keys":
        from flywheel.keys import run_keys_command

        return run_keys_command(args, settings)
    raise AssertionError(f"unhandled command {command}")


if __name__ == "__main__":
    sys.exit(main())
