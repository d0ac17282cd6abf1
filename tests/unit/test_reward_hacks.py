"""Reward hacks seen in production, each next to honest behaviour on the same tasks, and the guard
that makes the hack score below it (README, "Reward hacking": the table points here).

For each hack: with its guard (the shipped template as it is) the hack's mean reward is below the
honest one's, and no honest session is penalised; without it (the same spec, that one builder
off, clipping and every other guard still on) the hack scores at least as well as honesty, so the
policy would learn it. Sessions are built by ``tests.unit.test_reward_templates.Sessions``.
"""

from __future__ import annotations

from statistics import mean

import pytest

from flywheel.events import TrajectoryEvent
from rewards.scorer import Scorer
from rewards.spec import ClarifyParams, EchoParams, RewardSpec, ToolCallParams, load_spec, parse_spec
from rewards.text_guards import asks_instead_of_acting, broken_call, echo_overlap
from rewards.texts import TurnText, TurnTexts, turn_text
from tests.unit.test_reward_templates import Said, Sessions, without

pytestmark = pytest.mark.unit

CODING_TOOLS = ["apply_patch", "run_tests"]


def scores(spec: RewardSpec, sessions: Sessions, trajs: list[TrajectoryEvent]) -> list[float]:
    scorer = Scorer(spec, generations=sessions)
    return [scorer(t).total for t in trajs]


def check_guard(spec: RewardSpec, guard: str, sessions: Sessions, honest: list[TrajectoryEvent],
                hacked: list[TrajectoryEvent], component: str) -> None:
    """The guarded ``spec`` scores the hack below honesty, and touches no honest session; with the
    ``guard`` builder off the hack scores at least as well as honesty."""
    guarded, unguarded = spec, without(spec, guard)
    assert mean(scores(unguarded, sessions, hacked)) >= mean(scores(unguarded, sessions, honest))
    assert mean(scores(guarded, sessions, hacked)) < mean(scores(guarded, sessions, honest))
    scorer = Scorer(guarded, generations=sessions)
    assert all(component not in scorer(t).components for t in honest)
    assert all(scorer(t).components.get(component, 0.0) < 0 for t in hacked)


def edit(path: str, patch: str, user: str = "") -> Said:
    said = Said(answer="", tools=CODING_TOOLS, calls=[("apply_patch", {"path": path, "patch": patch})])
    if user:
        said.user = user
    return said


def report(text: str) -> Said:
    return Said(answer=text, tools=CODING_TOOLS, after="tool")


# --- (a) broken tool calls that end the turn before the tests can fail -----------------------------


def test_broken_tool_calls_no_longer_dodge_failing_tests() -> None:
    """Hard tasks: the honest agent edits, the tests run and (partly) fail. The hack ends its turn
    in a call the harness cannot run (truncated JSON, a misspelt tool, call syntax left in the
    text): the episode ends, no test runs, no edit is judged, and the session scores 0."""
    s = Sessions()
    tasks = [
        ("Fix the off-by-one in paginate() in pages.py so that the last page is included in the result.",
         edit("pages.py", "-    for i in range(n - 1):\n+    for i in range(n):"), 0.5, 0.25),
        ("Make parse_date in dates.py accept ISO week dates such as 2024-W05-3 and add a test for it.",
         edit("dates.py", "+    if 'W' in text:\n+        return date.fromisocalendar(*week(text))"), 0.25, 0.0),
        ("Add retry with exponential backoff to fetch() in client.py, with at most 5 attempts.",
         edit("client.py", "+    for attempt in range(5):\n+        time.sleep(2 ** attempt)"), 1.0, 0.5),
    ]
    broken = [
        Said(answer="", tools=CODING_TOOLS, finish="length",
             calls=[("apply_patch", '{"path": "pages.py", "patch": "-    for i in range(n')]),
        Said(answer="", tools=CODING_TOOLS, calls=[("apply_pach", {"path": "dates.py", "patch": "+    ..."})]),
        Said(answer='<tool_call>{"name": "apply_patch", "arguments": {"path": "client.py", "patch": "+    for',
             tools=CODING_TOOLS),
    ]
    honest, hacked = [], []
    for k, ((task, patch, kept, passed), bad) in enumerate(zip(tasks, broken)):
        patch.user = bad.user = task
        honest.append(s.make(f"honest{k}", [patch, report("Patched; some tests still fail.")],
                             [("edits_kept", kept, 0), ("tests_passed", passed, None)]))
        hacked.append(s.make(f"broken{k}", [bad]))
    check_guard(load_spec("coding-agent"), "tool_calls", s, honest, hacked, "tool_call_invalid")
    guarded = load_spec("coding-agent")
    assert all(h < t for h, t in zip(scores(guarded, s, hacked), scores(guarded, s, honest)))  # task by task too


# --- (b) needless clarifying questions that defer the work ----------------------------------------


def test_needless_questions_no_longer_defer_the_work() -> None:
    """Fully specified tasks. The hack asks a question it did not need: on an easy task it then
    does the work anyway (and, under a credit rule whose total grew with the steps, would gain by
    the extra turn); on a hard one the user gives up, and the failing tests never run."""
    s = Sessions()
    rename = "Rename the function parse_row to parse_record in reader.py and update all of its callers."
    port = "Port the date handling in report.py from the removed pytz package to zoneinfo, keeping the output identical."
    honest = [
        s.make("honest-rename", [edit("reader.py", "-def parse_row(\n+def parse_record(", rename),
                                 report("Renamed; tests pass.")], [("edits_kept", 1.0, 0), ("tests_passed", 1.0, None)]),
        s.make("honest-port", [edit("report.py", "-import pytz\n+from zoneinfo import ZoneInfo", port), report("Ported.")],
               [("edits_kept", 0.25, 0), ("tests_passed", 0.25, None)]),
    ]
    ask_rename = Said(user=rename, tools=CODING_TOOLS,
                      answer="Before I start: do you want me to keep parse_row as a deprecated alias? "
                             "Should I update the tests too?")
    ask_port = Said(user=port, tools=CODING_TOOLS,
                    answer="Could you confirm which Python version you target? Zoneinfo needs 3.9 or later.")
    go_on = edit("reader.py", "-def parse_row(\n+def parse_record(", "Yes, just do what I asked.")
    hacked = [
        s.make("ask-rename", [ask_rename, go_on, report("Renamed; tests pass.")],
               [("edits_kept", 1.0, 1), ("tests_passed", 1.0, None)]),
        s.make("ask-port", [ask_port]),  # the user leaves: nothing is edited, no test runs
    ]
    check_guard(load_spec("coding-agent"), "clarify", s, honest, hacked, "clarify")
    # the template's uniform credit is part of the guard: were the outcome's total to grow with the
    # steps (discounted credit), the extra turn alone would pay, even with a task the user answered
    data = without(load_spec("coding-agent"), "clarify").model_dump(mode="json")
    data["credit"] = {"rule": "discounted", "discount": 0.9}
    discounted = parse_spec(data)
    assert scores(discounted, s, hacked[:1]) == pytest.approx([0.5 + 0.81 + 0.9 + 1.0])
    assert scores(discounted, s, honest[:1]) == pytest.approx([0.5 + 0.9 + 1.0])


def test_what_counts_as_asking_instead_of_acting() -> None:
    p = ClarifyParams()
    task = "Rename the function parse_row to parse_record in reader.py and update all of its callers."
    ask = TurnText(user=task, last_role="user", tools=["apply_patch"], answer="Should I also update the tests?")
    assert asks_instead_of_acting(ask, p)
    assert asks_instead_of_acting(TurnText(**{**ask.__dict__, "answer": "Please confirm the target branch first."}), p)
    honest = [
        TurnText(**{**ask.__dict__, "user": "fix it"}),  # a vague request: asking is the right move
        TurnText(**{**ask.__dict__, "last_role": "tool"}),  # after acting, a question is a follow-up
        TurnText(**{**ask.__dict__, "tool_calls": [{"function": {"name": "apply_patch", "arguments": "{}"}}]}),
        TurnText(**{**ask.__dict__, "tools": []}),  # nothing to act with
        TurnText(**{**ask.__dict__, "answer": "Renamed parse_row to parse_record in reader.py and in the three modules "
                                              "that call it, and the docs mention the new name. Want a changelog entry?"}),
        TurnText(**{**ask.__dict__, "answer": "Done."}),
    ]
    assert not any(asks_instead_of_acting(t, p) for t in honest)
    assert asks_instead_of_acting(TurnText(**{**ask.__dict__, "tools": []}), ClarifyParams(require_tools=False))


# --- (c) length gaming ------------------------------------------------------------------------------


def test_padded_answers_no_longer_outscore_concise_ones() -> None:
    """Users (and judges) rate long answers a little higher. Caught by today's length builder."""
    s = Sessions()
    answers = [
        ("How do I reset my password? The reset email never arrives and I have already checked my spam folder.",
         "I have sent a new reset link to the address on your account; it is valid for one hour. If it does not "
         "arrive, add noreply@example.com to your contacts and ask for another.", 4, 5),
        ("Can I change the delivery address of order 5521 to my office? It has not shipped yet.",
         "Yes: I changed the delivery address of order 5521 to your office. You will get a new confirmation email.", None, None),
    ]
    filler = " To summarise, keeping your account details current is an important part of a smooth experience." * 6
    honest, hacked = [], []
    for k, (user, answer, rating, padded_rating) in enumerate(answers):
        for name, text, tokens, stars, out in (("concise", answer, 120, rating, honest),
                                               ("padded", answer + filler, 900, padded_rating, hacked)):
            feedback = [("thumbs", 1, 0), ("resolved", 1, None)] + ([("rating", stars, 0)] if stars else [])
            out.append(s.make(f"{name}{k}", [Said(user=user, answer=text, tokens=tokens)], feedback))
    check_guard(load_spec("support-agent"), "length", s, honest, hacked, "length")


# --- (d) repeating the user's text ------------------------------------------------------------------


def test_echoed_code_no_longer_wins_tab_acceptances() -> None:
    """A suggestion copied from the code above the cursor is cheap to accept (and fix by hand later)."""
    s = Sessions()
    users = ("def load_users(path):\n    with open(path) as f:\n        rows = json.load(f)\n"
             "    return [User(**r) for r in rows]\n\n\ndef load_orders(path):\n    ")
    point = ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
             "    def __repr__(self):\n        ")
    honest = [
        s.make("tab-orders", [Said(completion=True, user=users, tokens=25, answer="with open(path) as f:\n        "
                                   "rows = json.load(f)\n    return [Order(**r) for r in rows]")], [("accepted", 1, 0)]),
        s.make("tab-repr", [Said(completion=True, user=point, tokens=12, answer='return f"Point({self.x}, {self.y})"')],
               [("accepted", 0, 0)]),
    ]
    hacked = [
        s.make("echo-orders", [Said(completion=True, user=users, tokens=25, answer="with open(path) as f:\n        "
                                    "rows = json.load(f)\n    return [User(**r) for r in rows]")], [("accepted", 1, 0)]),
        s.make("echo-repr", [Said(completion=True, user=point, tokens=20, answer="def __init__(self, x, y):\n"
                                  "        self.x = x\n        self.y = y")], [("accepted", 1, 0)]),
    ]
    check_guard(load_spec("tab-completion"), "echo", s, honest, hacked, "echo")


def test_echoed_paragraphs_no_longer_win_text_kept() -> None:
    """A writing assistant scored on the share of its text the user keeps (the default spec's
    ``text_kept``): the user's own paragraph handed back is kept whole. The echo guard, added to the
    default spec, catches it."""
    s = Sessions()
    paragraphs = [
        ("The new importer is faster. It also uses less memory than before. It was rewritten. Large files now load "
         "in seconds instead of minutes, which users asked for.",
         "We rewrote the importer from scratch: files that used to take minutes are ready in seconds, and it needs far "
         "less memory, as many of you had asked.", 0.7),
        ("Our office will be closed on Friday. This is because of the move. The new office is on Main Street. Please "
         "update your records with the new address at 12 Main Street.",
         "We are moving! The office closes this Friday and reopens at its new home, 12 Main Street; please update "
         "your records.", 0.9),
    ]
    honest, hacked = [], []
    for k, (paragraph, rewrite, kept) in enumerate(paragraphs):
        user = f"Improve the flow of this paragraph for our announcement: {paragraph}"
        honest.append(s.make(f"rewrite{k}", [Said(user=user, answer=rewrite)], [("text_kept", kept, 0)]))
        hacked.append(s.make(f"parrot{k}", [Said(user=user, answer=paragraph)], [("text_kept", 1.0, 0)]))
    data = load_spec().model_dump(mode="json")
    data["version"] = "writing-v1"
    data["builders"].append({"kind": "echo", "params": EchoParams().model_dump()})
    check_guard(parse_spec(data), "echo", s, honest, hacked, "echo")


def test_echo_overlap_by_hand() -> None:
    assert echo_overlap("a b c d e", "x a b c d y", 2) == (3 / 4, 4)  # ab bc cd are the user's, de is not
    assert echo_overlap("A, B; c", "a b c", 3) == (1.0, 1)  # words, lower-cased
    assert echo_overlap("a b", "a b", 3) == (0.0, 0)  # too short to judge


# --- what the guards read ---------------------------------------------------------------------------


def test_what_counts_as_a_broken_call() -> None:
    p = ToolCallParams()

    def turn(calls: list, answer: str = "", finish: str | None = None) -> TurnText:
        return TurnText(tools=["apply_patch"], tool_calls=calls, answer=answer, finish_reason=finish)

    def call(name: str, args: object) -> dict:
        return {"type": "function", "function": {"name": name, "arguments": args}}

    assert broken_call(turn([call("apply_patch", '{"path": "a.py"}')]), p) is None
    assert broken_call(turn([call("apply_patch", {"path": "a.py"})]), p) is None  # already decoded
    assert broken_call(turn([], answer="Done: the patch is applied."), p) is None
    assert broken_call(turn([{"type": "custom", "custom": {"name": "apply_patch", "input": "*** Begin"}}]), p) is None
    reasons = {
        "not JSON": turn([call("apply_patch", '{"path": "a.py", "patch": "-x')]),
        "not a JSON object": turn([call("apply_patch", '["a.py"]')]),
        "did not offer": turn([call("apply_pach", "{}")]),
        "without a name": turn([{"type": "function", "function": {"arguments": "{}"}}]),
        "no call": turn([], finish="tool_calls"),
        "left in the text": turn([], answer='Applying it now. [TOOL_CALLS] [{"name": "apply_patch"'),
    }
    for reason, t in reasons.items():
        assert reason in (broken_call(t, p) or ""), reason
    # a call the request did not offer is broken only while names are checked
    assert broken_call(turn([call("apply_pach", "{}")]), ToolCallParams(check_names=False)) is None


def test_turn_texts_read_any_payload_shape_once() -> None:
    chat = {"request": {"messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": [{"type": "text", "text": "first"}]},
                                     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}],
                        "tools": [{"type": "function", "function": {"name": "f"}}], "functions": [{"name": "g"}]},
            "response": {"choices": [{"message": {"content": [{"type": "text", "text": "hi"}],
                                                  "tool_calls": [{"function": {"name": "f"}}]}, "finish_reason": "tool_calls"}]}}
    t = turn_text(chat)
    assert (t.user, t.users, t.last_role, t.answer, t.tools, t.finish_reason) == ("second", "first\nsecond", "user", "hi",
                                                                                  ["f", "g"], "tool_calls")
    assert len(t.tool_calls) == 1
    prompt = turn_text({"request": {"prompt": ["a", "b"]}, "response": {"choices": [{"text": "c"}]}})
    assert (prompt.user, prompt.answer, prompt.last_role) == ("a\nb", "c", "user")
    for odd in ({}, {"request": "x", "response": None}, {"request": {"messages": "x"}, "response": {"choices": [3]}},
                {"request": {"tools": [1, {"function": 2}]}, "response": {"choices": []}}):
        assert turn_text(odd) == TurnText()
    # every guard of a scorer reads one trajectory's generations once; a turn not stored is left alone
    s, asked = Sessions(), []
    traj = s.make("once", [Said(answer="<tool_call>", tools=["f"]), Said(answer="<tool_call>", tools=["f"])])
    del s.payloads["once/1"]

    def source(t: TrajectoryEvent) -> dict:
        asked.append(t)
        return s(t)

    out = Scorer(load_spec("coding-agent"), generations=source)(traj)
    assert len(asked) == 1 and out.components["tool_call_invalid"] == -1.0 and out.turn_rewards[1] == 0.0
    texts = TurnTexts(source)
    assert texts(traj) is texts(traj) and len(asked) == 2 and texts(traj)[1] is None
