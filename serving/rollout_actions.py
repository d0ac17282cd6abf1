"""Operator actions on a line's versions, and how the fleet hears of a change.

:func:`manual_promote`, :func:`manual_rollback`, :func:`manual_pin`, :func:`manual_unpin` and
:func:`manual_clear` are what ``flywheel rollout promote|rollback|pin|unpin|clear``
(serving/rollout_cli.py) and the gateway's admin routes do (the controller, serving/rollout.py,
rolls back a stable version no node can load itself, restoring what the fleet serves). A pinned line
refuses promote, rollback and clear unless forced (the rules: serving/rollout.py's docstring).
:func:`operate` is one of those actions as the gateway's admin routes and the console run it (the
reason audited with who asked, then announced). :func:`announce` puts new statuses on the versions
topic; :func:`node_waker` is the registry's hook that wakes the nodes after a change (best effort:
they poll the registry anyway).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from flywheel.events import VersionEvent
from flywheel.settings import Settings
from flywheel.weights.codec.state import state_sha256
from flywheel.weights.registry import LinePinned, PinInfo, StatusChanged, VersionNotFound, WeightsError
from serving.rollout_policy import previous_stable

log = logging.getLogger(__name__)


class RolloutError(Exception):
    """A manual rollout command that cannot be applied (the message says why)."""

    code = "rollout_conflict"


class Pinned(RolloutError):
    """The line is pinned and the command was not forced."""

    code = "line_pinned"


class VerificationFailed(RolloutError):
    """A version to clear does not rebuild to its recorded hash (it stays ``rolled_back``)."""

    code = "verification_failed"


def _refuse_pinned(pin: PinInfo, action: str, forced: str = "and moves the pin") -> Pinned:
    return Pinned(f"model line {pin.model_line!r} is pinned to {pin.describe()}; {action} is refused while pinned: "
                  f"`flywheel rollout unpin` resumes rollout, `flywheel rollout pin V` moves the pin, "
                  f"--force {action}s anyway {forced}")


def manual_promote(registry: Any, version: int, reason: str = "", *, force: bool = False,
                   by: str = "operator") -> list[int]:
    """Make ``version`` stable (audited); returns the versions whose status changed. On a pinned
    line refused (:class:`Pinned`) unless ``force``, which moves the pin to ``version``. A
    ``rolled_back`` version (perhaps one a failed load implicated) is first re-verified as
    :func:`manual_clear` does (:func:`reverify`): a promotion never skips the check a clear makes."""
    info = registry.get(version)
    if info.status == "collected":
        raise RolloutError(f"v{version} was garbage-collected; its weights are gone")
    if info.status == "stable":
        raise RolloutError(f"v{version} is already stable")
    note = f": {reason}" if reason else ""
    if info.status == "rolled_back":
        note = f"; {reverify(registry, info)}{note}"
    pin = registry.pinned()
    if pin is not None:
        if not force:
            raise _refuse_pinned(pin, "promote")
        return _pin(registry, version, by, f"forced promote (was {info.status}){note}")[1]
    try:
        registry.set_status(version, "stable", reason=f"manual promote (was {info.status}){note}")
    except LinePinned as exc:  # pinned since we looked
        raise _refuse_pinned(exc.pin, "promote") from None
    return [version]


def manual_rollback(registry: Any, version: int, reason: str = "", *, force: bool = False,
                    by: str = "operator") -> list[int]:
    """Roll back a canary, or the stable version (restoring :func:`previous_stable` first). On a
    pinned line refused (:class:`Pinned`) unless ``force``: rolling back the pinned version then
    moves the pin to the version restored."""
    info = registry.get(version)
    note = f": {reason}" if reason else ""
    pin = registry.pinned()
    if pin is not None and not force:
        raise _refuse_pinned(pin, "rollback")
    try:
        if info.status == "canary":
            registry.set_status(version, "rolled_back", reason=f"manual rollback of canary{note}",
                                override_pin=force)
            return [version]
        if info.status != "stable":
            raise RolloutError(f"v{version} is {info.status}; only a canary or the stable version can be rolled back")
        restore = previous_stable(registry.versions(), registry.transitions(), version)
        if restore is None:
            raise RolloutError(f"no earlier stable version (not rolled back or collected) to restore instead of "
                               f"v{version}")
        if pin is not None:  # forced: the pin follows the restored version, which retires this one
            _, changed = _pin(registry, restore, by, f"forced rollback of v{version}: restored{note}")
            registry.set_status(version, "rolled_back", reason=f"forced rollback by {by}; v{restore} restored{note}",
                                expect="retired", override_pin=True)
            return [*changed, version]
        registry.set_status(restore, "stable", reason=f"manual rollback of v{version}: restored{note}")
        registry.set_status(version, "rolled_back", reason=f"manual rollback; v{restore} restored{note}")
    except LinePinned as exc:  # pinned since we looked
        raise _refuse_pinned(exc.pin, "rollback") from None
    except StatusChanged as exc:
        raise RolloutError(f"v{version} changed meanwhile: {exc}") from None
    return [restore, version]


def chain_of(versions: Sequence[Any], version: int) -> list[Any]:
    """``version``'s chain as a load walks it: its full anchor first, then each delta up to it."""
    by_number = {v.version: v for v in versions}
    chain = [by_number[version]]
    while chain[-1].kind == "delta" and chain[-1].parent in by_number and chain[-1].parent < chain[-1].version:
        chain.append(by_number[chain[-1].parent])
    return chain[::-1]


def manual_clear(registry: Any, version: int, reason: str = "", *, force: bool = False,
                 by: str = "operator") -> list[int]:
    """Clear a ``rolled_back`` version (one a failed load implicated, or any other): re-verify it
    end to end (:meth:`Registry.load` rebuilds it from its full anchor and checks every hash on the
    chain; the result is hashed once more against its row), then move it back to ``candidate``,
    audited with who cleared it and that it was re-verified. A failed re-verification leaves it
    ``rolled_back`` (:class:`VerificationFailed`, saying why). The controller canaries it again only
    while it is newer than stable. On a pinned line refused (:class:`Pinned`) unless ``force``
    (the pin stays where it is)."""
    info = registry.get(version)  # VersionNotFound for an unknown version
    if info.status != "rolled_back":
        raise RolloutError(f"v{version} is {info.status}; only a rolled-back version can be cleared")
    pin = registry.pinned()
    if pin is not None and not force:
        raise _refuse_pinned(pin, "clear", "(the pin stays)")
    verified = reverify(registry, info)
    note = f": {reason}" if reason else ""
    why = f"cleared by {by}: {verified}; was rolled_back{note}"
    try:
        registry.set_status(version, "candidate", reason=why, expect="rolled_back", override_pin=force)
    except LinePinned as exc:  # pinned since we looked
        raise _refuse_pinned(exc.pin, "clear", "(the pin stays)") from None
    except StatusChanged as exc:
        raise RolloutError(f"v{version} changed meanwhile: {exc}") from None
    return [version]


def reverify(registry: Any, info: Any) -> str:
    """Rebuild a rolled-back version from its full anchor with every hash on its chain checked
    (:meth:`Registry.load`), and its result against its row; what was checked, for the audit, or
    :class:`VerificationFailed` saying why it stays ``rolled_back``."""
    version = info.version
    chain = " -> ".join(f"v{v.version}" + (" (full)" if v.kind == "full" else "")
                        for v in chain_of(registry.versions(), version))
    try:
        got = state_sha256(registry.load(version))
    except WeightsError as exc:
        raise VerificationFailed(f"v{version} stays rolled_back: re-verification of {chain} failed: {exc}") from None
    if got != info.sha256:  # pragma: no cover - Registry.load's own invariant
        raise VerificationFailed(f"v{version} stays rolled_back: it rebuilds to {got[:12]}, expected {info.sha256[:12]}")
    return f"re-verified end to end ({chain}, every hash checked, sha256 {got[:12]})"


def _pin(registry: Any, version: int, by: str, reason: str) -> tuple[PinInfo, list[int]]:
    try:
        pin, changed = registry.pin(version, by=by, reason=reason)
    except VersionNotFound:
        raise
    except WeightsError as exc:  # collected meanwhile, or the weights do not rebuild to the hash
        raise RolloutError(f"cannot pin v{version}: {exc}") from None
    return pin, [i.version for i in changed]


def manual_pin(registry: Any, version: int, by: str, reason: str = "") -> tuple[PinInfo, list[int]]:
    """Pin the line to ``version`` (see the module docstring); returns the pin and the versions
    whose status changed (the pinned one when it was not stable, an ended canary)."""
    info = registry.get(version)  # VersionNotFound for an unknown version
    if info.status == "collected":
        raise RolloutError(f"v{version} was garbage-collected; its weights are gone and it cannot be pinned")
    return _pin(registry, version, by, reason)


def manual_unpin(registry: Any, by: str, reason: str = "") -> PinInfo:
    """Lift the line's pin (audited); returns the pin lifted."""
    lifted = registry.unpin(by=by, reason=reason)
    if lifted is None:
        raise RolloutError(f"model line {registry.model_line!r} is not pinned")
    return lifted


#: The actions :func:`operate` runs on one version.
VERSION_ACTIONS = ("promote", "rollback", "pin", "clear")


def operate(settings: Settings, registry: Any, action: str, version: int, who: str, reason: str = "",
            force: bool = False) -> dict[str, Any]:
    """``promote``, ``rollback``, ``pin`` or ``clear`` ``version`` for ``who`` (audited with
    ``reason``), then announce the changed statuses (a bus that is down only loses the notice: nodes
    follow the registry). Returns ``{"changed": [{"version", "status"}], "pin"?: ...}``; raises
    :class:`RolloutError` (refused) or ``VersionNotFound``."""
    pin = None
    if action == "pin":
        pin, changed = manual_pin(registry, version, who, reason)
    else:
        act = {"promote": manual_promote, "rollback": manual_rollback, "clear": manual_clear}[action]
        note = reason if action == "clear" else f"{who}: {reason}" if reason else who
        changed = act(registry, version, note, force=force, by=who)
    infos = [registry.get(v) for v in changed]
    try:
        announce(settings, infos)
    except Exception as exc:  # the bus is down: the change stands (nodes follow the registry)
        log.warning("version change not announced on the bus: %s", exc)
    result: dict[str, Any] = {"changed": [{"version": i.version, "status": i.status} for i in infos]}
    if pin is not None:
        result["pin"] = pin_figures(pin)
    return result


def pin_figures(pin: PinInfo) -> dict[str, Any]:
    return {"version": pin.version, "by": pin.by, "at": pin.at.isoformat(), "reason": pin.reason}


def version_event(info: Any) -> VersionEvent:
    """The wire notice of a version's new status (``session_id`` is the model line: its bus key)."""
    return VersionEvent(
        tenant="_system", session_id=info.model_line, model_line=info.model_line, version=info.version,
        kind=info.kind, parent=info.parent, sha256=info.sha256, status=info.status, bytes=info.bytes,
        full_bytes=info.full_bytes,
    )


def announce(settings: Settings, infos: Sequence[Any]) -> None:
    """Put the new status of each of ``infos`` on the versions topic."""
    from flywheel.bus import make_bus

    bus = make_bus(settings)
    try:
        topic = settings.topic(VersionEvent.topic)
        bus.ensure_topics([topic])
        producer = bus.producer()
        try:
            for info in infos:
                producer.send(topic, info.model_line, version_event(info).to_bytes())
            producer.flush()
        finally:
            producer.close()
    finally:
        bus.close()


def node_waker(settings: Settings) -> Callable[[Any], None]:
    """Wakes the nodes after a status change (``flywheel.live`` notification; best effort: the
    nodes poll the registry anyway)."""
    from flywheel.live import make_live
    from serving.node.updater import version_channel

    def wake(info: Any) -> None:
        live = make_live(settings)
        try:
            live.notify(version_channel(info.model_line))
        except Exception as exc:  # Redis away: the nodes find the change at their next poll
            log.warning("could not notify the nodes of v%s: %s", info.version, exc)
        finally:
            live.close()

    return wake
