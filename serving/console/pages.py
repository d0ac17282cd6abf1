"""What each console page shows, gathered: the database reads, the controller's decision, the
capture and the bus, as one plain dict per page for its template.

Each builder runs in a worker thread with one database session. The overview's decision is the one
the rollout role recorded at its last tick (:mod:`serving.rollout_record`); when none is recent, it
is evaluated here exactly as ``flywheel rollout status`` does, and the page says which it shows.
The canary page adds the promotion gates' verdicts that decision carries (:func:`evidence`); a
version's page, what it observed of each product metric (``queries.observed``).
"""

from __future__ import annotations

import math
import threading
import time
from datetime import UTC, datetime
from typing import Any

from jinja2 import Undefined

from flywheel.db.trained import trained_count
from flywheel.settings import Settings
from serving.console import charts, queries
from serving.rollout_record import last_decision

#: Versions the reward chart spans (the newest).
CHART_VERSIONS = 200
#: Seconds a bus-lag reading is shown before it is read again.
LAG_TTL_S = 5.0


def counter_total(counter: Any) -> float:
    """The sum of a Prometheus counter over its labels."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def throughput(recent: list[queries.VersionRow]) -> dict[str, float | None]:
    """Samples and tokens trained per second over the recent versions (newest first)."""
    trained = [v for v in recent if v.metrics.get("samples")]
    if len(trained) < 2:
        return {"samples_per_s": None, "tokens_per_s": None, "versions_per_h": None}
    span = (trained[0].created_at - trained[-1].created_at).total_seconds()
    if span <= 0:
        return {"samples_per_s": None, "tokens_per_s": None, "versions_per_h": None}
    body = trained[:-1]  # what was trained after the oldest one was published
    return {"samples_per_s": sum(v.metrics["samples"] for v in body) / span,
            "tokens_per_s": sum(v.metrics.get("tokens", 0) for v in body) / span,
            "versions_per_h": len(body) / span * 3600}


def decision(settings: Settings, sessions: Any, registry_factory: Any) -> dict[str, Any]:
    """The controller's next decision: what it decided at its last tick while nothing was published
    since and that tick is recent, else evaluated now exactly as the controller would (with no
    session of the caller's open: on SQLite every transaction holds the write lock)."""
    with sessions() as db:
        recorded = last_decision(db, settings.model.line)
        newest = queries.newest_version(db, settings.model.line)
    now = datetime.now(UTC)
    fresh_s = 3 * settings.rollout.interval_s + 30
    if (recorded is not None and (now - recorded["at"]).total_seconds() <= fresh_s
            and not (newest and newest[1] > recorded["at"])):
        due = max(0.0, settings.rollout.interval_s - (now - recorded["at"]).total_seconds())
        return {**recorded, "source": f"the rollout role's last tick; next tick in about {fmt_num(due)} s"}
    import serving.rollout

    evaluated = serving.rollout.evaluate(registry_factory(), sessions, settings.rollout, now,
                                         settings.product_metrics())
    if recorded is None:
        why = "no decision of the rollout role recorded"
    elif newest and newest[1] > recorded["at"]:
        why = f"v{newest[0]} was published after the rollout role's last tick"
    else:
        why = f"the rollout role's last tick was at {recorded['at']:%Y-%m-%d %H:%M:%S} UTC"
    return {"action": evaluated.action, "version": evaluated.version, "reason": evaluated.reason,
            "figures": evaluated.figures, "at": now, "source": f"evaluated now by the console ({why})"}


def overview(settings: Settings, sessions: Any, registry_factory: Any, capture: dict[str, Any],
             counters: dict[str, float], lags: dict[str, Any]) -> dict[str, Any]:
    line = settings.model.line
    with sessions() as db:
        serving = queries.serving_versions(db, line)
        recent = queries.recent_versions(db, line, 10)
        spec = queries.latest_spec(db)
        lo = min((v.version for v in recent), default=0)
        hi = max((v.version for v in recent), default=0)
        reward = queries.rewards(db, line, spec, lo, hi)
        open_sessions = queries.open_sessions(db)
    chosen = decision(settings, sessions, registry_factory)
    return {"line": line, "stable": [v for v in serving if v.status == "stable"],
            "canary": [v for v in serving if v.status == "canary"], "pinned": [v for v in serving if v.pinned],
            "decision": chosen, "capture": capture, "counters": counters, "lags": lags, "recent": recent,
            "rewards": reward, "spec": spec, "throughput": throughput(recent), "open_sessions": open_sessions,
            "policy": settings.rollout}


def versions(settings: Settings, sessions: Any, before: int | None) -> dict[str, Any]:
    line = settings.model.line
    with sessions() as db:
        newest = queries.newest_version(db, line)
        rows = queries.recent_versions(db, line, queries.PAGE, before)
        spec = queries.latest_spec(db)
        numbers = [r.version for r in rows]
        top = newest[0] if newest is not None else 0
        charted = queries.rewards(db, line, spec, max(0, top - CHART_VERSIONS + 1), top)
        shown = queries.rewards(db, line, spec, min(numbers), max(numbers)) if numbers else {}
        counts = queries.served_counts(db, line, min(numbers), max(numbers)) if numbers else {}
        audit = queries.transitions(db, line, numbers)
    chart = charts.line_chart(
        {"training reward (mean)": [(v, r["train"]) for v, r in sorted(charted.items())],
         "held-out reward (mean)": [(v, r["held_out"]) for v, r in sorted(charted.items())]},
        title=f"reward per version of {line}, last {CHART_VERSIONS} (spec {spec or '-'})", x_label="version",
        y_label="mean reward")
    older = rows[-1].version if rows and rows[-1].version > 0 else None
    return {"line": line, "rows": rows, "rewards": shown, "counts": counts, "audit": audit, "spec": spec,
            "chart": chart, "newest": top, "older": older, "before": before}


def version(settings: Settings, sessions: Any, number: int) -> dict[str, Any] | None:
    line = settings.model.line
    with sessions() as db:
        row = queries.one_version(db, line, number)
        if row is None:
            return None
        spec = queries.latest_spec(db)
        reward = queries.rewards(db, line, spec, number, number).get(number)
        counts = queries.served_counts(db, line, number, number).get(number)
        audit = queries.transitions(db, line, [number])[number]
        trained = queries.trained_in(db, line, number)
        trained_n = trained_count(db, line, number)
        observed = queries.observed(db, settings.product_metrics(), line, number)
    staleness = sorted(((k, float(n)) for k, n in (row.metrics.get("staleness") or {}).items()), key=lambda kv: int(kv[0]))
    hist = charts.bar_chart(staleness, title=f"staleness of v{number}'s samples", x_label="versions behind",
                            y_label="samples")
    return {"line": line, "v": row, "spec": spec, "reward": reward, "counts": counts, "audit": audit,
            "trained": trained, "trained_n": trained_n, "hist": hist, "observed": observed}


def canary(settings: Settings, sessions: Any, registry_factory: Any) -> dict[str, Any]:
    line = settings.model.line
    with sessions() as db:
        serving = queries.serving_versions(db, line)
        recent = queries.recent_versions(db, line, 20)
    chosen = decision(settings, sessions, registry_factory)
    figures = chosen.get("figures") or {}
    tests = []
    for name, test in (figures.get("tests") or {}).items():
        tests.append({"name": name, "statistic": test.get("statistic"),
                      "p": test.get("p"), "significant": test.get("p") is not None
                      and test["p"] < settings.rollout.alpha})
    return {"line": line, "stable": [v for v in serving if v.status == "stable"],
            "canary": [v for v in serving if v.status == "canary"], "pinned": [v for v in serving if v.pinned],
            "decision": chosen, "figures": figures, "tests": tests, "evidence": evidence(figures), "recent": recent,
            "policy": settings.rollout}


def evidence(figures: dict[str, Any]) -> dict[str, Any] | None:
    """The promotion gates' verdicts a decision's figures carry (``figures["evidence"]``,
    serving/rollout_metrics.py), each interval written as a person reads it (an open end, recorded
    as null, is infinite); None when the line has no gates."""
    found = figures.get("evidence")
    if not isinstance(found, dict):
        return None
    verdicts = [{**v, "interval": f"[{_bound(v.get('lower'), '-inf')}, {_bound(v.get('upper'), '+inf')}]"}
                for v in found.get("verdicts") or () if isinstance(v, dict)]
    return {"canary": found.get("canary"), "since": _when(found.get("since")), "action": found.get("action"),
            "verdicts": verdicts}


def _bound(value: Any, open_end: str) -> str:
    finite = isinstance(value, int | float) and math.isfinite(value)
    return fmt_num(value) if finite else open_end


def _when(iso: Any) -> datetime | None:
    """An ISO time as the figures carry it (UTC when it names no zone); None when it is not one."""
    try:
        at = datetime.fromisoformat(iso) if isinstance(iso, str) else None
    except ValueError:
        return None
    return at if at is None or at.tzinfo else at.replace(tzinfo=UTC)


def session_list(settings: Settings, sessions: Any, tenant: str | None, query: str | None,
                 before: datetime | None = None) -> dict[str, Any]:
    tenant = tenant or settings.gateway.default_tenant
    with sessions() as db:
        found = queries.find_sessions(db, query) if query else None
        recent = [] if query else queries.recent_sessions(db, tenant, queries.PAGE, before)
        tenants = queries.tenants(db, settings.gateway.default_tenant)
    older = recent[-1]["last_event_at"].isoformat() if len(recent) == queries.PAGE else None
    return {"tenant": tenant, "query": query or "", "found": found, "recent": recent, "tenants": tenants,
            "older": older, "before": before}


def session(settings: Settings, sessions: Any, tenant: str, session_id: str) -> dict[str, Any]:
    with sessions() as db:
        story = queries.session_story(db, tenant, session_id)
    return {"story": story}


def fmt_age(at: datetime | None) -> str:
    """How long ago ``at`` was, in words a dashboard uses."""
    if at is None:
        return "-"
    s = (datetime.now(UTC) - at).total_seconds()
    if s < 90:
        return f"{s:.0f} s ago"
    if s < 5400:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.1f} h ago" if s < 172800 else f"{s / 86400:.0f} d ago"


def fmt_num(value: Any, digits: int = 3) -> str:
    """A figure for a table cell: "-" when absent, thousands grouped, small floats to ``digits``."""
    if value is None or isinstance(value, Undefined):
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if abs(value) >= 1000 or isinstance(value, int):
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


class LagReader:
    """Bus lag per stage, read at most every :data:`LAG_TTL_S` (a broker round trip per read), one
    reader at a time over one bus client; the app's lifespan closes it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._bus: Any = None
        self._at = 0.0
        self._value: dict[str, Any] = {}
        self._lock = threading.Lock()

    def read(self) -> dict[str, Any]:
        with self._lock:
            if time.monotonic() - self._at >= LAG_TTL_S:
                self._read()
            return self._value

    def _read(self) -> None:
        from flywheel.bus import make_bus
        from flywheel.bus.base import BusError, stage_lags

        try:
            if self._bus is None:
                self._bus = make_bus(self.settings)
            self._value = {"stages": stage_lags(self._bus, self.settings), "error": None}
        except (BusError, OSError) as exc:
            self._value = {"stages": {}, "error": f"{type(exc).__name__}: {exc}"[:300]}
            self._drop()
        self._at = time.monotonic()

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._bus is not None:
            try:
                self._bus.close()
            finally:
                self._bus = None
