"""The LLM-judge builder against a real local HTTP server speaking /v1/chat/completions, with the
conversation read from stored generations (SQLite)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from flywheel.db.models import Generation
from flywheel.db.session import insert_ignore, make_engine, make_session_factory, upgrade
from flywheel.events import GenerationEvent, SamplingParams, Segment, TrajectoryEvent, Turn
from rewards.judge import JudgeError, parse_score, scale_score, transcript_of
from rewards.scorer import Scorer
from rewards.spec import JudgeParams, load_spec
from rewards.store import DbTranscripts

pytestmark = pytest.mark.integration

KEY = "judge-secret"


class JudgeServer:
    """Grades 9 when the transcript contains the right answer 'a d m q', else 3; ``fail_first`` answers
    500 that many times first; ``reply`` overrides the text."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.fail_first = 0
        self.reply: str | None = None
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                if outer.fail_first:
                    outer.fail_first -= 1
                    return self._send(500, {"error": {"message": "overloaded"}})
                if self.headers.get("Authorization") != f"Bearer {KEY}":
                    return self._send(401, {"error": {"message": "bad key"}})
                transcript = body["messages"][1]["content"]
                text = outer.reply or f"The answer is {'right' if 'ASSISTANT: a d m q' in transcript else 'wrong'}.\nScore: " \
                                      f"{9 if 'ASSISTANT: a d m q' in transcript else 3}"
                self._send(200, {"id": "j", "object": "chat.completion", "model": body["model"],
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                              "finish_reason": "stop"}]})

            def _send(self, status: int, payload: dict) -> None:
                raw = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture
def judge_server() -> Iterator[JudgeServer]:
    server = JudgeServer()
    thread = threading.Thread(target=server.httpd.serve_forever, daemon=True)
    thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def generation(session_id: str, gid: str, messages: list[dict], answer: str) -> GenerationEvent:
    return GenerationEvent(tenant="acme", session_id=session_id, generation_id=gid, model_line="m", model_version=1,
                           node_id="n", request={"messages": messages},
                           response={"choices": [{"message": {"role": "assistant", "content": answer}}]},
                           prompt_token_ids=[1, 2], completion_token_ids=[3], completion_logprobs=[-0.5],
                           sampling=SamplingParams(), latency_ms=1.0)


def session(session_id: str, answers: list[str]) -> tuple[list[GenerationEvent], TrajectoryEvent]:
    messages: list[dict] = [{"role": "user", "content": "sort these letters: q d m a"}]
    gens = []
    tokens, mask, turns = [], [], []
    for i, answer in enumerate(answers):
        gens.append(generation(session_id, f"{session_id}-g{i}", list(messages), answer))
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "that's wrong, try again"}]
        tokens += [1, 2, 3]
        mask += [0, 0, 1]
        turns.append(Turn(generation_id=f"{session_id}-g{i}", start=len(tokens) - 1, end=len(tokens), behaviour_version=1))
    seg = Segment(tokens=tokens, mask=mask, logprobs=[0.0 if m == 0 else -0.5 for m in mask], turns=turns)
    traj = TrajectoryEvent(tenant="acme", session_id=session_id, trajectory_id=f"t-{session_id}", model_line="m",
                           segments=[seg], generation_ids=[g.generation_id for g in gens], feedback=[],
                           closed_reason="inactivity")
    return gens, traj


def judge_spec(tmp_path: Path, url: str, extra: str = "") -> object:
    path = tmp_path / "judge.toml"
    path.write_text(
        'extends = "default"\nversion = "judge-v1"\n[credit]\nrule = "last_turn"\n'
        f'[[builders]]\nkind = "judge"\nweight = 2.0\nparams = {{ base_url = "{url}", model = "grader", attempts = 3{extra} }}\n'
    )
    return load_spec(path)


def test_judge_grades_sessions_from_stored_generations(tmp_path: Path, sqlite_url: str, judge_server: JudgeServer) -> None:
    upgrade(sqlite_url)
    sessions = make_session_factory(make_engine(sqlite_url))
    right_gens, right = session("right", ["a d m g", "a d m q"])
    wrong_gens, wrong = session("wrong", ["q d m a"])
    with sessions() as db, db.begin():
        insert_ignore(db, Generation, [
            {"event_id": g.event_id, "generation_id": g.generation_id, "tenant": g.tenant, "session_id": g.session_id,
             "model_line": g.model_line, "model_version": g.model_version, "node_id": g.node_id,
             "ts": datetime.now(UTC), "payload": g.model_dump(mode="json")}
            for g in right_gens + wrong_gens
        ])
    scorer = Scorer(judge_spec(tmp_path, judge_server.url), transcripts=DbTranscripts(sessions), judge_api_key=KEY)
    try:
        good = scorer(right)
        bad = scorer(wrong)
    finally:
        scorer.close()
    # 9 on 1..10 -> 2 * 8/9 - 1 = 7/9, weight 2, on the last turn (last_turn credit); 3 -> -5/9 x 2
    assert good.turn_rewards == pytest.approx([0.0, 14 / 9]) and good.components == pytest.approx({"judge": 14 / 9})
    assert bad.turn_rewards == pytest.approx([-10 / 9])
    request = judge_server.requests[0]
    assert request["path"] == "/v1/chat/completions" and request["auth"] == f"Bearer {KEY}"
    body = request["body"]
    assert body["model"] == "grader" and body["temperature"] == 0
    assert body["messages"][0] == {"role": "system", "content": JudgeParams().rubric}
    # the whole conversation as the user saw it: both attempts and the retry message, in order
    assert re.search(r"USER: sort these letters: q d m a\s+ASSISTANT: a d m g\s+USER: that's wrong, try again\s+"
                     r"ASSISTANT: a d m q$", body["messages"][1]["content"])


def test_judge_retries_server_errors_then_fails_loudly_or_scores_zero(tmp_path: Path, judge_server: JudgeServer) -> None:
    _, traj = session("s", ["a d m q"])
    conversation = [{"role": "user", "content": "sort: q d m a"}, {"role": "assistant", "content": "a d m q"}]
    scorer = Scorer(judge_spec(tmp_path, judge_server.url), transcripts=lambda t: conversation, judge_api_key=KEY)
    try:
        judge_server.fail_first = 2  # two 500s, then an answer: within 3 attempts
        assert scorer(traj).total == pytest.approx(14 / 9)
        judge_server.fail_first = 3
        with pytest.raises(JudgeError, match="after 3 attempt"):
            scorer(traj)
        judge_server.reply = "I would rather not say."
        with pytest.raises(JudgeError, match="no score"):
            scorer(traj)
    finally:
        scorer.close()
    unauthorised = Scorer(judge_spec(tmp_path, judge_server.url), transcripts=lambda t: conversation, judge_api_key="nope")
    judge_server.reply = None
    try:
        with pytest.raises(JudgeError, match="HTTP 401"):
            unauthorised(traj)
    finally:
        unauthorised.close()
    lenient = Scorer(judge_spec(tmp_path, judge_server.url, ', on_error = "zero"'), transcripts=lambda t: conversation,
                     judge_api_key=KEY)
    judge_server.reply = "no idea"
    try:
        out = lenient(traj)
    finally:
        lenient.close()
    assert out.total == 0.0 and out.components == {"judge_failed": 0.0}  # recorded, scores nothing


def test_score_parsing_and_transcripts() -> None:
    assert parse_score("Reasoning...\nScore: 7") == 7.0
    assert parse_score("score=3 at first, final Score: 8.5") == 8.5
    assert parse_score(" 6 ") == 6.0 and parse_score("seven") is None
    p = JudgeParams(min_score=0, max_score=4)
    assert [scale_score(s, p) for s in (0, 1, 2, 4, 9, -3)] == [-1.0, -0.5, 0.0, 1.0, 1.0, -1.0]
    assert transcript_of([]) == []
    completion = {"request": {"prompt": "2+2="}, "response": {"choices": [{"text": "4"}]}}
    assert transcript_of([completion]) == [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]


def test_judge_is_off_by_default_and_needs_transcripts(tmp_path: Path) -> None:
    assert "judge" not in [name for name, *_ in Scorer(load_spec()).builders]
    from rewards.spec import SpecError

    with pytest.raises(SpecError, match="transcripts"):
        Scorer(judge_spec(tmp_path, "http://127.0.0.1:9"))
