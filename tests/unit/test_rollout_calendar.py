"""The release calendar: window grammar and its validation, windows across time zones and DST
changes, freezes, the daily limit, soak, and the next opportunity when several rules hold."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from pydantic import ValidationError

from flywheel.release_windows import ReleaseWindow, parse_window, parse_windows
from flywheel.settings import RolloutSettings, SettingsError, load_settings
from serving.rollout_calendar import Calendar, check, instants, next_day, next_opportunity, next_window, summary

pytestmark = pytest.mark.unit

BERLIN = ZoneInfo("Europe/Berlin")
OFFICE = ["mon-fri 09:00-17:00"]


def cal(**policy) -> Calendar:
    return Calendar.of(RolloutSettings(**policy))


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def berlin(*args: int) -> datetime:
    return datetime(*args, tzinfo=BERLIN)


# --- the grammar and its validation -----------------------------------------------------------------


def test_windows_parse_in_both_spellings():
    assert parse_window("mon-fri 09:00-17:00") == [ReleaseWindow("mon-fri 09:00-17:00", (0, 1, 2, 3, 4), 540, 1020)]
    assert parse_window("Sat,sun 10:30-24:00")[0].days == (5, 6)
    assert parse_window("daily 00:00-24:00")[0] == ReleaseWindow("daily 00:00-24:00", tuple(range(7)), 0, 1440)
    assert parse_window("mon,wed-fri 08:00-09:00")[0].days == (0, 2, 3, 4)
    # The cron form: every minute of hours 9..16 on Monday..Friday is the same window.
    (cron,) = parse_window("* 9-16 * * 1-5")
    assert (cron.days, cron.start, cron.end) == ((0, 1, 2, 3, 4), 540, 1020)
    # Runs of hours become windows; 0 and 7 are both Sunday; names work.
    assert [(w.days, w.start, w.end) for w in parse_window("* 8,9,14-15 * * sun,sat")] == [
        ((5, 6), 480, 600), ((5, 6), 840, 960)]
    assert parse_window("* * * * 0")[0] == ReleaseWindow("* * * * 0", (6,), 0, 1440)
    assert parse_window("* 22-23 * * 7")[0].days == (6,)


@pytest.mark.parametrize(("text", "message"), [
    ("mon-fry 09:00-17:00", "unknown day 'fry'"),
    ("fri-mon 09:00-17:00", "range 'fri-mon' is inverted"),
    ("mon-fri 17:00-09:00", "ends before it starts: to span midnight write two windows"),
    ("mon 09:00-09:00", "ends before it starts"),
    ("mon 9:00-17:00", "'9:00' is not a time of day"),
    ("mon 09:00-24:30", "'24:30' is not a time of day"),
    ("mon,mon 09:00-10:00", "names a day twice"),
    ("weekdays", "is not a release window"),
    ("mon 09:00 17:00", "is not a release window"),
    ("0 9-16 * * 1-5", "only the hour and day-of-week fields"),
    ("* 9-16 1 * *", "only the hour and day-of-week fields"),
    ("* 9-24 * * *", "unknown hour '24'"),
    ("* 16-9 * * *", "range '16-9' is inverted"),
])
def test_malformed_windows_are_refused_with_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_window(text)


def test_overlapping_windows_are_refused_naming_both_and_the_day():
    with pytest.raises(ValueError, match="'mon-fri 09:00-17:00' and 'fri 16:00-18:00' overlap on fri"):
        parse_windows(["mon-fri 09:00-17:00", "fri 16:00-18:00"])
    with pytest.raises(ValueError, match="overlap on tue"):
        parse_windows(["mon-fri 09:00-17:00", "* 12 * * 2"])
    # Touching windows do not overlap: an overnight window is two windows.
    assert len(parse_windows(["fri 22:00-24:00", "sat 00:00-02:00", "fri 09:00-22:00"])) == 3


def test_settings_validation_reports_every_calendar_problem_at_once():
    with pytest.raises(SettingsError) as err:
        load_settings(rollout={"timezone": "Europe/Berlinn", "windows": ["mon-fri 17:00-09:00", "sun 25:00-26:00"],
                               "max_promotions_per_day": -1, "min_soak_s": -5,
                               "freezes": [{"start": "2026-12-20T00:00", "end": "2026-12-24T00:00"}]})
    text = str(err.value)
    assert "rollout.timezone" in text and "unknown time zone 'Europe/Berlinn'" in text
    assert "rollout.windows" in text and "'mon-fri 17:00-09:00' ends before it starts" in text and "'25:00'" in text
    assert "rollout.max_promotions_per_day" in text and "rollout.min_soak_s" in text
    assert "rollout.freezes.0.reason" in text
    with pytest.raises(ValidationError, match=r"freezes\[0\] \(launch week\) ends before it starts"):
        RolloutSettings(freezes=[{"start": "2026-12-24", "end": "2026-12-20", "reason": "launch week"}])
    with pytest.raises(ValidationError, match="unknown time zone"):
        RolloutSettings(timezone="../etc/passwd")


def test_freezes_without_an_offset_are_in_the_calendar_time_zone():
    policy = RolloutSettings(timezone="Europe/Berlin", freezes=[
        {"start": "2026-12-21T00:00", "end": "2027-01-04", "reason": "year end"},
        {"start": "2026-12-01T12:00:00Z", "end": "2026-12-01T13:00:00+00:00", "reason": "db migration"}])
    year_end, migration = policy.freezes
    assert year_end.start == berlin(2026, 12, 21) and year_end.start.astimezone(UTC) == utc(2026, 12, 20, 23)
    assert migration.start == utc(2026, 12, 1, 12)
    assert load_settings(rollout=policy.model_dump(mode="json")).rollout.freezes[0].start == year_end.start


# --- windows, time zones, DST -----------------------------------------------------------------------


def test_outside_the_window_it_waits_for_the_next_opening_and_says_so():
    c = cal(timezone="Europe/Berlin", windows=OFFICE)
    friday_evening = berlin(2026, 11, 27, 18, 30)
    verdict = check(c, friday_evening)
    assert not verdict.ok and verdict.held == ("window",)
    assert verdict.next_at == berlin(2026, 11, 30, 9) == utc(2026, 11, 30, 8)
    assert verdict.reason == ("outside the release windows (mon-fri 09:00-17:00 Europe/Berlin); "
                              "next window opens 2026-11-30 09:00 CET")
    assert verdict.figures["next_window"] == "2026-11-30T09:00:00+01:00" and not verdict.figures["open_now"]
    assert check(c, berlin(2026, 11, 30, 9)).ok  # start inclusive
    assert check(c, berlin(2026, 11, 30, 16, 59, 59)).ok
    assert not check(c, berlin(2026, 11, 30, 17)).ok  # end exclusive
    assert check(c, berlin(2026, 11, 30, 17)).next_at == berlin(2026, 12, 1, 9)
    # Same instant, another zone: 18:30 in Berlin is 12:30 in New York, inside its office hours.
    assert check(cal(timezone="America/New_York", windows=OFFICE), friday_evening).ok
    assert check(cal(timezone="Asia/Tokyo", windows=OFFICE), friday_evening).next_at == utc(2026, 11, 30, 0)


def test_the_cron_form_opens_the_same_windows():
    human, cron = cal(windows=OFFICE, timezone="Europe/Berlin"), cal(windows=["* 9-16 * * 1-5"], timezone="Europe/Berlin")
    for t in [berlin(2026, 11, 27, 18), berlin(2026, 11, 28, 10), berlin(2026, 11, 30, 8, 59), berlin(2026, 12, 2, 12)]:
        assert check(human, t).ok == check(cron, t).ok and next_window(human, t) == next_window(cron, t)


def test_office_hours_keep_their_local_time_across_the_spring_dst_change():
    c = cal(timezone="Europe/Berlin", windows=OFFICE)
    # Friday 27 March 2026, after hours (CET, +01:00); the clocks go forward on Sunday 29 March.
    opens = next_window(c, berlin(2026, 3, 27, 17, 30))
    assert opens == utc(2026, 3, 30, 7)  # Monday 09:00 CEST (+02:00), not 08:00 UTC as the Friday before
    assert c.show(opens) == "2026-03-30 09:00 CEST"
    assert not check(c, utc(2026, 3, 30, 6, 30)).ok  # 08:30 CEST: would be 07:30 CET, but it is CEST now


def test_a_window_across_the_spring_forward_is_an_hour_shorter_and_one_in_the_gap_opens_at_the_jump():
    spanning = cal(timezone="Europe/Berlin", windows=["sun 01:00-04:00"])
    # 29 March 2026: 02:00 CET jumps to 03:00 CEST (01:00 UTC).
    assert next_window(spanning, utc(2026, 3, 28, 12)) == utc(2026, 3, 29, 0)  # 01:00 CET
    open_utc = [h for h in range(0, 4) if check(spanning, utc(2026, 3, 29, h, 30)).ok]
    assert open_utc == [0, 1]  # 01:30 CET and 03:30 CEST: two hours, not three
    in_gap = cal(timezone="Europe/Berlin", windows=["sun 02:30-05:00"])
    assert instants(datetime(2026, 3, 29, 2, 30), BERLIN) == [utc(2026, 3, 29, 1)]
    assert next_window(in_gap, utc(2026, 3, 28, 12)) == utc(2026, 3, 29, 1)  # the jump: 03:00 CEST
    assert check(in_gap, utc(2026, 3, 29, 1)).ok and not check(in_gap, utc(2026, 3, 29, 0, 59, 59)).ok
    # A window wholly inside the skipped hour does not open that day: a week later.
    skipped = cal(timezone="Europe/Berlin", windows=["sun 02:10-02:50"])
    assert next_window(skipped, utc(2026, 3, 28, 12)) == berlin(2026, 4, 5, 2, 10) == utc(2026, 4, 5, 0, 10)


def test_the_repeated_hour_of_the_autumn_change_is_inside_a_window_on_both_passes():
    c = cal(timezone="Europe/Berlin", windows=["sun 02:00-02:30"])
    # 25 October 2026: 03:00 CEST goes back to 02:00 CET; 02:00-03:00 happens twice.
    first = next_window(c, utc(2026, 10, 24, 12))
    assert first == utc(2026, 10, 25, 0)  # 02:00 CEST
    assert check(c, utc(2026, 10, 25, 0, 15)).ok and not check(c, utc(2026, 10, 25, 0, 45)).ok
    assert next_window(c, utc(2026, 10, 25, 0, 45)) == utc(2026, 10, 25, 1)  # 02:00 CET
    assert c.show(utc(2026, 10, 25, 1)) == "2026-10-25 02:00 CET"


def test_no_rules_always_allows():
    c = cal()
    assert not c.rules and check(c, utc(2026, 11, 28, 3)).ok
    assert check(c, utc(2026, 11, 28, 3), [utc(2026, 11, 28, 1)] * 5, utc(2026, 11, 28, 3)).ok


# --- freezes, the daily limit, soak -------------------------------------------------------------------


def test_a_freeze_holds_until_it_ends_and_then_the_window_decides():
    c = cal(timezone="Europe/Berlin", windows=OFFICE, freezes=[
        {"start": "2026-12-21T00:00", "end": "2027-01-04T12:00", "reason": "year-end freeze"},
        {"start": "2026-12-01T10:00", "end": "2026-12-01T11:00", "reason": "db migration"}])
    v = check(c, berlin(2026, 12, 22, 10))
    assert v.held == ("freeze",) and v.next_at == berlin(2027, 1, 4, 12)
    assert v.reason == ("release freeze: year-end freeze (until 2027-01-04 12:00 CET); "
                        "next opportunity 2027-01-04 12:00 CET")
    assert v.figures["freeze"]["reason"] == "year-end freeze"
    # Frozen and outside the window: the freeze ends on a Saturday, so the next Monday 09:00.
    weekend = cal(timezone="Europe/Berlin", windows=OFFICE,
                  freezes=[{"start": "2026-12-21T00:00", "end": "2026-12-26T12:00", "reason": "holidays"}])
    v = check(weekend, berlin(2026, 12, 25, 20))
    assert v.held == ("freeze", "window") and v.next_at == berlin(2026, 12, 28, 9)
    # The short freeze: before it, the next one shows; at its end the promotion may go.
    assert check(c, berlin(2026, 12, 1, 9)).figures["next_freeze"]["reason"] == "db migration"
    assert check(c, berlin(2026, 12, 1, 10, 30)).next_at == berlin(2026, 12, 1, 11)
    assert check(c, berlin(2026, 12, 1, 11)).ok


def test_overlapping_freezes_hand_over():
    c = cal(freezes=[{"start": "2026-12-01T00:00Z", "end": "2026-12-03T00:00Z", "reason": "a"},
                     {"start": "2026-12-02T00:00Z", "end": "2026-12-05T00:00Z", "reason": "b"},
                     {"start": "2026-12-05T00:00Z", "end": "2026-12-06T00:00Z", "reason": "c"}])
    assert next_opportunity(c, utc(2026, 12, 1, 6)) == utc(2026, 12, 6)


def test_the_daily_limit_counts_promotions_on_the_local_day_and_reopens_the_next_one():
    c = cal(timezone="America/New_York", max_promotions_per_day=2)
    now = utc(2026, 11, 27, 20)  # 15:00 in New York
    late_yesterday = utc(2026, 11, 27, 3)  # 22:00 on the 26th in New York, the 27th in UTC
    assert check(c, now, [late_yesterday, utc(2026, 11, 27, 14)]).ok  # one today
    v = check(c, now, [late_yesterday, utc(2026, 11, 27, 14), utc(2026, 11, 27, 18)])
    assert v.held == ("limit",) and v.next_at == utc(2026, 11, 28, 5)  # New York midnight
    assert "daily limit reached: 2 automatic promotions on 2026-11-27 (America/New_York), " \
           "max_promotions_per_day 2" in v.reason
    assert v.figures["promotions_today"] == 2
    # With windows: the next local day's first open window (Monday, the 28th being a Saturday).
    office = cal(timezone="America/New_York", windows=OFFICE, max_promotions_per_day=1)
    v = check(office, utc(2026, 11, 27, 20), [utc(2026, 11, 27, 15)])
    assert v.held == ("limit",) and office.show(v.next_at) == "2026-11-30 09:00 EST"


def test_the_next_local_day_follows_dst():
    c = cal(timezone="Europe/Berlin")
    assert next_day(c, berlin(2026, 3, 28, 12)) - berlin(2026, 3, 28, 0) == timedelta(hours=24)
    assert next_day(c, berlin(2026, 3, 29, 12)) - next_day(c, berlin(2026, 3, 28, 12)) == timedelta(hours=23)
    assert next_day(c, berlin(2026, 10, 25, 12)) - next_day(c, berlin(2026, 10, 24, 12)) == timedelta(hours=25)
    # A zone whose midnight was skipped (Santiago, 6 September 2026): the day starts at 01:00.
    santiago = cal(timezone="America/Santiago")
    start = next_day(santiago, datetime(2026, 9, 5, 12, tzinfo=ZoneInfo("America/Santiago")))
    assert santiago.local(start) == datetime(2026, 9, 6, 1)


def test_soak_holds_a_fresh_version_until_min_soak_s_has_passed():
    c = cal(min_soak_s=3600)
    started = utc(2026, 11, 27, 10)
    v = check(c, started + timedelta(minutes=10), soak_start=started)
    assert v.held == ("soak",) and v.next_at == utc(2026, 11, 27, 11)
    assert "soaking 600s of min_soak_s 3600 (until 2026-11-27 11:00 UTC)" in v.reason
    assert check(c, started + timedelta(hours=1), soak_start=started).ok
    assert check(c, started + timedelta(minutes=10)).ok  # no soak start: nothing to soak
    # Soaked after the window closed: the next window.
    office = cal(timezone="Europe/Berlin", windows=OFFICE, min_soak_s=7200)
    v = check(office, berlin(2026, 11, 27, 16), soak_start=berlin(2026, 11, 27, 15, 30))
    assert v.held == ("soak",) and v.next_at == berlin(2026, 11, 30, 9)


def test_every_rule_at_once():
    c = cal(timezone="Europe/Berlin", windows=["mon-fri 09:00-12:00"], max_promotions_per_day=1, min_soak_s=1800,
            freezes=[{"start": "2026-11-30T09:00", "end": "2026-11-30T11:00", "reason": "audit"}])
    now = berlin(2026, 11, 27, 11, 50)  # Friday, inside the window, but one promotion today
    v = check(c, now, [berlin(2026, 11, 27, 9, 30)], soak_start=now - timedelta(minutes=5))
    assert v.held == ("soak", "limit")
    # Soak ends 12:15 (window closed) -> Monday 09:00 (frozen) -> 11:00 (open, nothing promoted Monday).
    assert v.next_at == berlin(2026, 11, 30, 11)
    lines = summary(v.figures)
    assert lines[0] == "release windows: mon-fri 09:00-12:00 (Europe/Berlin): open now"
    assert "next release freeze 2026-11-30T09:00:00+01:00 to 2026-11-30T11:00:00+01:00: audit" in lines
    assert "automatic promotions today: 1 of max_promotions_per_day 1" in lines
    assert lines[-1] == "a promotion now would wait (soak, limit); next opportunity 2026-11-30 11:00 CET"
