"""A scenario's result, and the table and details ``flywheel chaos`` prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from chaos.invariants import InvariantResult


@dataclass
class ScenarioResult:
    name: str
    faults: list[str]
    summary: str
    events: int = 0
    lost: int = 0
    duplicated: int = 0
    invariants: list[InvariantResult] = field(default_factory=list)
    error: str | None = None
    wall_s: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def invariants_ok(self) -> bool:
        return self.error is None and bool(self.invariants) and all(r.ok for r in self.invariants)

    @property
    def failed_invariants(self) -> list[str]:
        return ([r.name for r in self.invariants if not r.ok]) + (["harness_error"] if self.error else [])

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "faults": self.faults, "events": self.events, "lost": self.lost,
            "duplicated": self.duplicated, "invariants_ok": self.invariants_ok,
            "failed_invariants": self.failed_invariants,
            "invariants": [asdict(r) for r in self.invariants], "summary": self.summary, "error": self.error,
            "wall_s": round(self.wall_s, 1), "figures": self.figures,
        }


def format_table(results: list[ScenarioResult]) -> str:
    """The Markdown table ``flywheel chaos`` prints (and the README shows)."""
    lines = ["| scenario | faults | events | lost | duplicated | invariants |",
             "|---|---|---|---|---|---|"]
    for r in results:
        if r.error:
            verdict = f"**harness error**: {r.error.splitlines()[0][:120]}"
        else:
            passed = sum(i.ok for i in r.invariants)
            failed = [i.name for i in r.invariants if not i.ok]
            verdict = f"{passed}/{len(r.invariants)} ok" + (f", **failed: {', '.join(failed)}**" if failed else "")
            diagnosis = r.figures.get("diagnosis")
            if (r.figures.get("settle") or {}).get("spool"):
                verdict += f" ({r.figures['settle']['spool']} events still in the gateway's spool)"
            if isinstance(diagnosis, dict) and diagnosis.get("lost_generations_unconsumed"):
                verdict += (f" ({diagnosis['lost_generations_unconsumed']} of the missing generations are on the bus, "
                            "never consumed)")
            groups = r.figures.get("groups")
            if isinstance(groups, dict):
                wedged = [g for g, v in groups.items() if "(control" not in g and "no partition" in v
                          and "got" in groups.get(f"{g} (control: a new group)", "") and "no partition" not in
                          groups.get(f"{g} (control: a new group)", "")]
                if wedged:
                    verdict += f" (consumer groups wedged at the broker: {', '.join(wedged)})"
            if isinstance(diagnosis, dict) and diagnosis.get("log_holes"):
                holes = "; ".join(f"{t}{', '.join(g[:3])}" for t, g in diagnosis["log_holes"].items())
                verdict += f" (the broker lost acknowledged records: holes in {holes})"
        lines.append(f"| {r.name} | {r.summary} | {r.events} | {r.lost} | {r.duplicated} | {verdict} |")
    return "\n".join(lines)


def format_details(results: list[ScenarioResult]) -> str:
    out = []
    for r in results:
        out.append(f"\n{r.name} ({r.wall_s:.0f} s): {'ok' if r.invariants_ok else 'FAILED'}")
        for fault in r.faults:
            out.append(f"  fault  {fault}")
        for inv in r.invariants:
            out.append(f"  {'ok  ' if inv.ok else 'FAIL'}   {inv.name}: {inv.detail}")
        if r.error:
            out.append(f"  ERROR  {r.error}")
        for key in ("settle", "crashes", "client_errors", "dead_letters", "lost_items", "diagnosis", "groups"):
            if r.figures.get(key):
                out.append(f"  {key}: {r.figures[key]}")
    return "\n".join(out)
