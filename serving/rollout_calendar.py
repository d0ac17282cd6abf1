"""The release calendar, pure: may a promotion to stable happen now, and if not, why and when next.

Four rules, all from ``rollout.*`` (flywheel/settings.py; the window grammar is
flywheel/release_windows.py):

- **windows**: weekly wall-clock spans in ``timezone`` (``mon-fri 09:00-17:00``). Wall-clock means
  the local time an instant shows, so a window keeps its local hours across a DST change (09:00 CET
  is 08:00 UTC, 09:00 CEST 07:00 UTC). On the day the clocks go forward, a window that starts in
  the skipped hour opens at the jump (and one wholly inside it does not open that day); on the day
  they go back, the repeated hour is inside a window on both passes. No windows: always open.
- **freezes**: absolute periods (``start`` inclusive, ``end`` exclusive) with a reason; they may
  overlap, and one that ends inside another simply hands over to it.
- **the daily limit**: at most ``max_promotions_per_day`` promotions per local calendar day of
  ``timezone`` (days of 23 or 25 hours included). The caller passes the promotions that count
  (serving/rollout.py: the controller's own, read from ``version_transitions``).
- **soak**: a promotion waits until ``min_soak_s`` after its ``soak_start`` (the caller's: when a
  canary became canary, or when a candidate promoted directly was published).

:func:`check` answers for one instant: allowed, or every rule that holds it, and the next
opportunity, the earliest instant at or after it at which every rule allows a promotion (a window
opening inside a freeze is no opportunity; a limit reached today moves to the next local day's
first open window). Only promotions ask: serving/rollout.py never holds a canary start (no
session moves unless it is new and drawn for the canary, and the canary is there to gather
evidence before the window opens) or a rollback (undoing harm never waits).

Invariants: pure functions of their arguments (no clock, no IO); instants in and out are aware
datetimes; figures are JSON-ready (ISO 8601 strings in the calendar's zone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from flywheel.release_windows import ReleaseWindow, parse_windows, time_zone
from flywheel.settings import RolloutSettings

#: Moves :func:`next_opportunity` may make (soak end, freeze end, window opening, next day) before
#: it gives up; each moves forward, and weekly windows recur, so a real calendar needs a handful.
MAX_MOVES = 64


@dataclass(frozen=True)
class Freeze:
    start: datetime
    end: datetime
    reason: str


@dataclass(frozen=True)
class Calendar:
    """The release calendar of one policy (:meth:`of`)."""

    zone: ZoneInfo
    windows: tuple[ReleaseWindow, ...] = ()
    freezes: tuple[Freeze, ...] = ()
    max_per_day: int = 0  # 0: no limit
    min_soak_s: float = 0.0

    @classmethod
    def of(cls, policy: RolloutSettings) -> Calendar:
        zone = time_zone(policy.timezone)
        freezes = tuple(Freeze(*(t if t.tzinfo else t.replace(tzinfo=zone) for t in (f.start, f.end)), f.reason)
                        for f in policy.freezes)  # naive only where validation was skipped (model_copy)
        return cls(zone, tuple(parse_windows(policy.windows)), freezes, policy.max_promotions_per_day,
                   policy.min_soak_s)

    @property
    def rules(self) -> bool:
        """Whether any rule can hold a promotion (else :func:`check` always allows one)."""
        return bool(self.windows or self.freezes or self.max_per_day or self.min_soak_s)

    @property
    def label(self) -> str:
        """The windows as written, and the zone: ``mon-fri 09:00-17:00 Europe/Berlin``."""
        return f"{', '.join(dict.fromkeys(w.text for w in self.windows))} {self.zone.key}"

    def local(self, t: datetime) -> datetime:
        """``t``'s wall-clock time in the calendar's zone (naive)."""
        return t.astimezone(self.zone).replace(tzinfo=None)

    def show(self, t: datetime) -> str:
        """``2026-11-30 09:00 CET``."""
        return t.astimezone(self.zone).strftime("%Y-%m-%d %H:%M %Z")

    def iso(self, t: datetime | None) -> str | None:
        return t.astimezone(self.zone).isoformat() if t is not None else None


def instants(wall: datetime, zone: ZoneInfo) -> list[datetime]:
    """The instants (UTC) at which the clocks of ``zone`` show the naive ``wall`` time: one; two
    when the clocks go back over it; for a time they skip, the one instant they jump past it."""
    first, second = wall.replace(tzinfo=zone, fold=0), wall.replace(tzinfo=zone, fold=1)
    if first.astimezone(UTC).astimezone(zone).replace(tzinfo=None) != wall:  # skipped: find the jump
        lo, hi = int(second.timestamp()), int(first.timestamp())  # shown: before ``wall``, after it
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if datetime.fromtimestamp(mid, zone).replace(tzinfo=None) >= wall:
                hi = mid
            else:
                lo = mid
        return [datetime.fromtimestamp(hi, UTC)]
    both = [first.astimezone(UTC), second.astimezone(UTC)]
    return both[:1] if both[0] == both[1] else both


def window_at(cal: Calendar, t: datetime) -> ReleaseWindow | None:
    """The window open at ``t``, or None (also when there are no windows)."""
    wall = cal.local(t)
    minutes = (wall - datetime.combine(wall.date(), time())) / timedelta(minutes=1)
    return next((w for w in cal.windows if wall.weekday() in w.days and w.start <= minutes < w.end), None)


def next_window(cal: Calendar, t: datetime) -> datetime | None:
    """The earliest instant at or after ``t`` inside a window: ``t`` when one is open (or there are
    none); None only for windows that never open (not a weekly calendar)."""
    if not cal.windows or window_at(cal, t) is not None:
        return t
    today = cal.local(t).date()
    for k in range(15):  # a window skipped by the clocks recurs a week later
        day = today + timedelta(days=k)
        opens = [at for w in cal.windows if day.weekday() in w.days
                 for at in instants(datetime.combine(day, time()) + timedelta(minutes=w.start), cal.zone)
                 if at > t and window_at(cal, at) is not None]
        if opens:
            return min(opens)
    return None


def freeze_at(cal: Calendar, t: datetime) -> Freeze | None:
    """The freeze in force at ``t`` that lasts longest, or None."""
    return max((f for f in cal.freezes if f.start <= t < f.end), key=lambda f: f.end, default=None)


def promotions_on(cal: Calendar, t: datetime, promotions: Sequence[datetime]) -> int:
    """How many of ``promotions`` fall on ``t``'s local day."""
    day = cal.local(t).date()
    return sum(1 for p in promotions if cal.local(p).date() == day)


def next_day(cal: Calendar, t: datetime) -> datetime:
    """The first instant of the local day after ``t``'s."""
    return instants(datetime.combine(cal.local(t).date() + timedelta(days=1), time()), cal.zone)[0]


def soak_end(cal: Calendar, soak_start: datetime | None) -> datetime | None:
    return soak_start + timedelta(seconds=cal.min_soak_s) if soak_start is not None and cal.min_soak_s else None


def next_opportunity(cal: Calendar, t: datetime, promotions: Sequence[datetime] = (),
                     soak_start: datetime | None = None) -> datetime | None:
    """The earliest instant at or after ``t`` at which every rule allows a promotion (None: none
    within :data:`MAX_MOVES` moves)."""
    soaked = soak_end(cal, soak_start)
    at: datetime | None = t
    for _ in range(MAX_MOVES):
        assert at is not None
        freeze = freeze_at(cal, at)
        if soaked is not None and at < soaked:
            at = soaked
        elif freeze is not None:
            at = freeze.end
        elif (opens := next_window(cal, at)) != at:
            at = opens
            if at is None:
                return None
        elif cal.max_per_day and promotions_on(cal, at, promotions) >= cal.max_per_day:
            at = next_day(cal, at)
        else:
            return at
    return None


@dataclass(frozen=True)
class Verdict:
    """:func:`check`'s answer: ``ok``, or the rules that hold a promotion (``held``: their names,
    ``reasons``: what each says) and the next opportunity; ``figures`` for status and logs."""

    ok: bool
    held: tuple[str, ...]
    reasons: tuple[str, ...]
    next_at: datetime | None
    figures: dict[str, Any]

    @property
    def reason(self) -> str:
        """Why it waits and until when: ``outside the release windows (...); next window opens ...``."""
        if self.ok:
            return "the release calendar allows it"
        when = self.figures["next_opportunity_text"]
        tail = "no opportunity found" if when is None else \
            f"next window opens {when}" if self.held == ("window",) else f"next opportunity {when}"
        return "; ".join([*self.reasons, tail])


def check(cal: Calendar, now: datetime, promotions: Sequence[datetime] = (),
          soak_start: datetime | None = None) -> Verdict:
    """May a promotion happen at ``now``, given the ``promotions`` that count toward the daily limit
    and when the version's soak started (None: no soak applies)?"""
    held: list[str] = []
    reasons: list[str] = []
    soaked = soak_end(cal, soak_start)
    if soaked is not None and now < soaked:
        assert soak_start is not None
        held.append("soak")
        reasons.append(f"soaking {(now - soak_start).total_seconds():.0f}s of min_soak_s {cal.min_soak_s:g} "
                       f"(until {cal.show(soaked)})")
    freeze = freeze_at(cal, now)
    if freeze is not None:
        held.append("freeze")
        reasons.append(f"release freeze: {freeze.reason} (until {cal.show(freeze.end)})")
    window = window_at(cal, now)
    if cal.windows and window is None:
        held.append("window")
        reasons.append(f"outside the release windows ({cal.label})")
    count = promotions_on(cal, now, promotions)
    if cal.max_per_day and count >= cal.max_per_day:
        held.append("limit")
        reasons.append(f"daily limit reached: {count} automatic promotion{'s' if count != 1 else ''} on "
                       f"{cal.local(now).date()} ({cal.zone.key}), max_promotions_per_day {cal.max_per_day}")
    next_at = now if not held else next_opportunity(cal, now, promotions, soak_start)
    upcoming = min((f for f in cal.freezes if f.start > now), key=lambda f: f.start, default=None)
    opens = next_window(cal, now)
    figures = {
        "timezone": cal.zone.key,
        "windows": list(dict.fromkeys(w.text for w in cal.windows)),
        "open_now": not cal.windows or window is not None,
        "next_window": cal.iso(opens),
        "next_window_text": cal.show(opens) if opens is not None else None,
        "freeze": ({"reason": freeze.reason, "start": cal.iso(freeze.start), "end": cal.iso(freeze.end)}
                   if freeze is not None else None),
        "next_freeze": ({"reason": upcoming.reason, "start": cal.iso(upcoming.start), "end": cal.iso(upcoming.end)}
                        if upcoming is not None else None),
        "promotions_today": count,
        "max_promotions_per_day": cal.max_per_day,
        "min_soak_s": cal.min_soak_s,
        "soak_until": cal.iso(soaked),
        "allowed": not held,
        "held_by": held,
        "next_opportunity": cal.iso(next_at),
        "next_opportunity_text": cal.show(next_at) if next_at is not None else None,
    }
    return Verdict(not held, tuple(held), tuple(reasons), next_at, figures)


def summary(figures: dict[str, Any]) -> list[str]:
    """A calendar's figures (:func:`check`, ``status_report``'s ``calendar``) as lines for a person."""
    zone = figures["timezone"]
    if figures["windows"]:
        state = "open now" if figures["open_now"] else f"closed; next window opens {figures['next_window_text']}"
        lines = [f"release windows: {', '.join(figures['windows'])} ({zone}): {state}"]
    else:
        lines = [f"release windows: none (promotions at any time; time zone {zone})"]
    freeze, upcoming = figures["freeze"], figures["next_freeze"]
    if freeze is not None:
        lines.append(f"release freeze until {freeze['end']}: {freeze['reason']}")
    if upcoming is not None:
        lines.append(f"next release freeze {upcoming['start']} to {upcoming['end']}: {upcoming['reason']}")
    if figures["max_promotions_per_day"]:
        lines.append(f"automatic promotions today: {figures['promotions_today']} of max_promotions_per_day "
                     f"{figures['max_promotions_per_day']}")
    if figures["min_soak_s"]:
        until = f" (the version waiting: until {figures['soak_until']})" if figures["soak_until"] else ""
        lines.append(f"min_soak_s {figures['min_soak_s']:g}{until}")
    if not figures["allowed"]:
        lines.append(f"a promotion now would wait ({', '.join(figures['held_by'])}); next opportunity "
                     f"{figures['next_opportunity_text']}")
    return lines
