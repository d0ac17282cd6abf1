"""Release windows as ``rollout.windows`` writes them: the weekly grammar and time zones, parsed and checked.

Two spellings of one weekly window, both wall-clock times in ``rollout.timezone``:

- ``DAYS HH:MM-HH:MM``: DAYS is a day name (``mon`` ... ``sun``), a forward range (``mon-fri``), a
  comma list of either (``mon,wed-fri``) or ``daily``; the span is ``start`` inclusive to ``end``
  exclusive, 00:00 to 24:00. A span that ends before it starts is an error: one that crosses
  midnight is written as two windows (``fri 22:00-24:00``, ``sat 00:00-02:00``).
- the 5-field cron form ``MIN HOUR DOM MONTH DOW``, limited to what is a weekly span of time:
  minute, day of month and month must be ``*``; HOUR and DOW take numbers, forward ranges and
  comma lists (DOW 0 or 7 is Sunday, or ``sun`` ... ``sat``). ``* 9-16 * * 1-5`` is every minute of
  hours 9 to 16 on Monday to Friday, so the window ``mon-fri 09:00-17:00``. Cron's other fields
  describe instants (minute 0 of an hour, the 1st of a month) rather than weekly spans, which is
  why they are refused instead of approximated.

Invariants: pure (no clock, no IO); every problem raises :class:`ValueError` with a message that
names the entry and what is wrong; windows of one list never overlap on any weekday.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

#: Day names, Monday first (``datetime.weekday()`` order); cron counts from Sunday.
WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
CRON_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
#: Minutes in a day: a window's ``end`` of 24:00.
DAY_MINUTES = 1440


@dataclass(frozen=True)
class ReleaseWindow:
    """One weekly window, parsed from the ``rollout.windows`` entry ``text``: the weekdays it opens
    on (0 = Monday) and its wall-clock span in minutes after local midnight, ``start`` inclusive,
    ``end`` exclusive (:data:`DAY_MINUTES` = 24:00)."""

    text: str
    days: tuple[int, ...]
    start: int
    end: int


def clock(text: str) -> int:
    """``HH:MM`` (00:00 to 24:00) as minutes after midnight."""
    match = re.fullmatch(r"([01]\d|2[0-4]):([0-5]\d)", text)
    if match is None or (match[1] == "24" and match[2] != "00"):
        raise ValueError(f"{text!r} is not a time of day HH:MM (00:00 to 24:00)")
    return int(match[1]) * 60 + int(match[2])


def values(text: str, low: int, high: int, what: str, names: tuple[str, ...]) -> list[int]:
    """A comma list of values and forward ``a-b`` ranges: numbers from ``low`` to ``high``, or
    ``names`` (their index). A value named twice is an error."""
    def one(item: str) -> int:
        if item.lower() in names:
            return names.index(item.lower())
        if item.isdigit() and low <= int(item) <= high:
            return int(item)
        raise ValueError(f"unknown {what} {item!r} in {text!r} (expected {', '.join(names) + ' or ' if names else ''}"
                         f"{low}-{high})")

    out: list[int] = []
    for part in text.split(","):
        first, dash, last = part.partition("-")
        a = one(first)
        b = one(last) if dash else a
        if b < a:
            raise ValueError(f"the {what} range {part!r} is inverted: write ranges forwards (split one that wraps, "
                             f"e.g. 'mon,fri-sun')")
        if set(range(a, b + 1)) & set(out):
            raise ValueError(f"{text!r} names a {what} twice")
        out += range(a, b + 1)
    return out


def cron_windows(text: str, hour: str, dow: str) -> list[ReleaseWindow]:
    """The cron form's windows: one per run of consecutive hours, on the days of ``dow``."""
    hours = range(24) if hour == "*" else sorted(values(hour, 0, 23, "hour", ()))
    days = range(7) if dow == "*" else {(d - 1) % 7 for d in values(dow, 0, 7, "day of week", CRON_DAYS)}
    runs: list[list[int]] = []
    for h in hours:
        if runs and runs[-1][1] == h:
            runs[-1][1] = h + 1
        else:
            runs.append([h, h + 1])
    return [ReleaseWindow(text, tuple(sorted(days)), a * 60, b * 60) for a, b in runs]


def parse_window(text: str) -> list[ReleaseWindow]:
    """One ``rollout.windows`` entry (module docstring): one window, or for the cron form one per
    run of consecutive hours."""
    fields = text.split()
    if len(fields) == 5:
        minute, hour, dom, month, dow = fields
        if (minute, dom, month) != ("*", "*", "*"):
            raise ValueError(f"{text!r}: a cron-form window sets only the hour and day-of-week fields (minute, "
                             "day of month and month must be '*': a window is a weekly span of whole hours)")
        return cron_windows(text, hour, dow)
    if len(fields) != 2 or fields[1].count("-") != 1:
        raise ValueError(f"{text!r} is not a release window: write 'DAYS HH:MM-HH:MM' (DAYS like mon-fri, sat,sun "
                         "or daily) or the cron form '* 9-16 * * 1-5'")
    days = range(7) if fields[0].lower() == "daily" else values(fields[0], 0, 6, "day", WEEKDAYS)
    start, end = (clock(t) for t in fields[1].split("-"))
    if start == DAY_MINUTES or end <= start:
        raise ValueError(f"{text!r} ends before it starts: to span midnight write two windows "
                         "(e.g. 'fri 22:00-24:00' and 'sat 00:00-02:00')")
    return [ReleaseWindow(text, tuple(sorted(days)), start, end)]


def parse_windows(texts: Sequence[str]) -> list[ReleaseWindow]:
    """Every entry of ``rollout.windows``; one :class:`ValueError` listing every problem (malformed
    entries, windows that overlap on a weekday)."""
    problems: list[str] = []
    windows: list[ReleaseWindow] = []
    for text in texts:
        try:
            windows += parse_window(text)
        except ValueError as exc:
            problems.append(str(exc))
    for day, name in enumerate(WEEKDAYS):
        spans = sorted((w.start, w.end, w.text) for w in windows if day in w.days)
        problems += [f"{a[2]!r} and {b[2]!r} overlap on {name}" for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
    if problems:
        raise ValueError("; ".join(dict.fromkeys(problems)))
    return windows


def time_zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name``; :class:`ValueError` naming it when this machine has no such zone."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r}: use an IANA name such as 'Europe/Berlin' or 'UTC' "
                         "(this machine's time zone database must have it)") from None
