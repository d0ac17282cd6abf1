"""The operator console in a real headless Chromium against a running ``flywheel up``.

One stack for the module: ``flywheel up`` as its own process (every role a child, embedded SQLite and
local bus, the quick tiny model) with ``gateway.auth = "on"``, an admin and a tenant key made with
``flywheel keys create``, real traffic through the gateway with the tenant key (the demo's simulated
users, and one session whose prompt and feedback comment are markup), and a candidate version
published beside the trainer's: the stable weights slightly nudged, so the node can load it once it is
promoted. The rollout controller decides once at start-up and then not for an hour, so nothing but
the test moves a version.

What must hold in the browser (the API-level checks are tests/integration/test_console.py):
- a tenant key's login is a 403 page and sets no cookie; an admin key's login sets an HttpOnly,
  SameSite=Strict cookie no script can read;
- every page (overview, versions, a version, canary, sessions browsed and found, a session) loads
  with no console error, uncaught exception, dialog or failed request, the overview's live refresh
  included, and the overview names the registry's stable version;
- a prompt holding ``<script>`` is shown as text and never runs;
- a form post without the CSRF token (from the console's own page, and from another site) is refused
  with 403 and changes nothing;
- Promote on the Canary page makes the candidate stable (registry, flash, new sessions served by it)
  and its reason appears in the Versions page and the version's audit.

With ``CONSOLE_SCREENSHOTS=DIR`` each page is saved to DIR as a full-page PNG at 1280 px wide: overview,
versions, version (the promoted one, with its audit), canary (after the Promote), sessions and session
(the README's screenshots, docs/console/).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from flywheel.db.models import Feedback, Generation, SessionState
from flywheel.settings import Settings, load_settings
from testbed.procs import free_port
from tests.fixtures.browser import Watched
from tests.fixtures.roles import wait_until
from tests.fixtures.traffic import clean_env, start_up

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
HOSTILE_PROMPT = "<script>window.__pwned=1;alert(1)</script> sort: b a"
HOSTILE_COMMENT = '<img src=x onerror="window.__pwned=2;alert(2)">'
REASON = "ship it: nudged copy looks fine <b>bold?</b>"
#: Where the README's screenshots go. Not FLYWHEEL_*: every variable with that prefix is a setting,
#: and an unknown setting stops load_settings (flywheel/settings.py).
SHOTS = os.environ.get("CONSOLE_SCREENSHOTS")
VIEWPORT = {"width": 1280, "height": 800}
MAX_SHOT_HEIGHT = 1100  # a long table (50 sessions) is cut here: the README needs its top only


@dataclass
class Stack:
    settings: Settings
    config: Path
    log: Path
    process: subprocess.Popen[bytes]
    keys: dict[str, str] = field(default_factory=dict)  # admin, tenant
    hostile: str = ""  # the session whose prompt is markup
    multi_turn: str = ""  # a simulated user's session of several turns
    candidate: int = -1  # the version the test publishes, for the Canary page's Promote

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.settings.gateway.port}"

    def cli(self, *argv: str) -> str:
        result = subprocess.run([sys.executable, "-m", "launch.cli", "--config", str(self.config), *argv], cwd=ROOT,
                                env=clean_env(), capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout

    def tail(self, lines: int = 30) -> str:
        logs = [self.log, *sorted((self.settings.data_path / "logs").glob("*.log"))]
        return "\n".join(f"== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
                         for p in logs if p.exists())

    def sessions(self) -> Any:
        from flywheel.db.session import make_engine, make_session_factory

        return make_session_factory(make_engine(self.settings.database_url))

    def registry(self) -> Any:
        from flywheel.weights.registry import Registry
        from flywheel.weights.store import make_store

        return Registry(self.sessions(), make_store(self.settings), self.settings.model.line)


def _stack_pids(root: Path) -> list[int]:
    """Processes whose command line names a file under ``root``: ``up`` (its settings file) and every
    role (``{data_dir}/effective-settings.json``)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if f"{root}/".encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue  # it exited meanwhile
    return pids


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("console-browser")
    settings = load_settings(
        data_dir=str(root / "data"),
        model={"path": str(tiny_model_dir)},
        gateway={"auth": "on", "port": free_port()},
        node={"port": free_port(), "poll_s": 0.2},
        # Sessions close a second after their last event, so trajectories, rewards and training show up.
        ingest={"inactivity_timeout_s": 1.0},
        trainer={"batch_size": 16},
        # One decision at start-up (the registry holds v0 alone), the next in an hour: nothing races
        # the test's Promote.
        rollout={"interval_s": 3600.0},
    )
    config, log, process = start_up(root, settings)
    up = Stack(settings, config, log, process)
    try:
        def ready() -> bool:
            assert process.poll() is None, f"flywheel up exited with {process.returncode}:\n{up.tail()}"
            return "flywheel is up" in log.read_text(errors="replace")

        wait_until("flywheel up to say it is up", ready, timeout_s=240, every_s=0.2)
        for who, argv in (("admin", ("--tenant", "ops", "--admin")), ("tenant", ("--tenant", "acme"))):
            up.keys[who] = json.loads(up.cli("keys", "create", "--name", f"console-{who}", "--json", *argv))["key"]
        _drive_traffic(up)
        up.candidate = _publish_candidate(up)
        yield up
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # `up` stops its children gracefully
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        deadline = time.monotonic() + 30
        while (left := _stack_pids(root)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert not left, f"processes outlived flywheel up: {left}"


def _drive_traffic(up: Stack) -> None:
    """The demo's simulated users for a few seconds, and meanwhile the hostile session; returns once
    ingest stored the hostile session's turn and feedback and closed it, and a multi-turn session."""
    from demo.users import UserPool

    settings = up.settings
    pool = UserPool(up.gateway, settings.model.line, users=3, seed=11, max_tokens=settings.node.max_new_tokens,
                    api_key=up.keys["tenant"])
    stop = threading.Event()
    pool.start(stop)
    up.hostile = f"hostile-{uuid.uuid4().hex[:8]}"
    with httpx.Client(base_url=up.gateway, headers={"Authorization": f"Bearer {up.keys['tenant']}"}, timeout=30) as client:
        r = client.post("/v1/chat/completions", headers={"X-Flywheel-Session": up.hostile},
                        json={"model": settings.model.line, "messages": [{"role": "user", "content": HOSTILE_PROMPT}],
                              "max_tokens": 8})
        assert r.status_code == 200, r.text
        gid = r.headers["X-Flywheel-Generation"]
        r = client.post("/v1/feedback", json={"feedback": [
            {"feedback_id": uuid.uuid4().hex, "session_id": up.hostile, "generation_id": gid, "kind": "explicit",
             "signal": "thumbs", "value": -1, "comment": HOSTILE_COMMENT}]})
        assert r.status_code == 202, r.text
    stop.wait(6.0)
    stop.set()
    pool.join(30)
    assert len(pool.stats.served) > 10 and not pool.stats.errors, (len(pool.stats.served), pool.stats.errors)

    sessions = up.sessions()

    def stored() -> bool:
        with sessions() as db:
            closed = db.scalar(select(SessionState.status).where(SessionState.tenant == "acme",
                                                                  SessionState.session_id == up.hostile))
            feedback = db.scalar(select(func.count()).select_from(Feedback).where(Feedback.session_id == up.hostile))
            multi = db.scalars(select(Generation.session_id).where(Generation.tenant == "acme")
                               .group_by(Generation.session_id).having(func.count() >= 2).limit(1)).first()
        if closed == "closed" and feedback and multi:
            up.multi_turn = multi
            return True
        return False

    wait_until("ingest to store and close the sessions", stored, timeout_s=60, every_s=0.3)


def _publish_candidate(up: Stack) -> int:
    """A child of the stable version whose weights differ a little (2% of one matrix's elements, by 5%):
    a real version the node can load."""
    import torch

    registry = up.registry()
    stable = registry.latest("stable")
    assert stable is not None
    state = registry.load(stable.version)
    name = max((n for n, t in state.items() if t.is_floating_point()), key=lambda n: state[n].numel())
    nudged = dict(state)
    tensor = state[name].clone()
    flat = tensor.view(-1)
    picked = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(5))[: flat.numel() // 50]
    flat[picked] += flat[picked].abs().clamp_min(1e-3) * 0.05
    nudged[name] = tensor
    return registry.publish(nudged, parent=stable.version, parent_state=state, metrics={"samples": 0}).version


@pytest.fixture
def context(chromium: Any, stack: Stack) -> Iterator[Any]:
    ctx = chromium.new_context(base_url=stack.gateway, viewport=VIEWPORT)
    ctx.set_default_timeout(30_000)  # a loaded 2-core machine has taken over 15 s to answer a login
    try:
        yield ctx
    finally:
        ctx.close()


def log_in(context: Any, key: str) -> Watched:
    """The login form, filled and sent as a person would; the page where it leads."""
    watched = Watched.open(context)
    page = watched.page
    page.goto("/console")
    assert page.url.endswith("/console/login"), page.url  # not logged in: sent to the form
    page.fill("input[name=key]", key)
    with page.expect_navigation():
        page.click("form[action='/console/login'] button[type=submit]")
    return watched


def admin(context: Any, stack: Stack) -> Watched:
    watched = log_in(context, stack.keys["admin"])
    assert watched.page.url == f"{stack.gateway}/console", watched.page.url
    watched.assert_clean("the login")
    return watched


def shoot(page: Any, name: str) -> None:
    """``page`` as ``{SHOTS}/{name}.png``: the whole page, cut at :data:`MAX_SHOT_HEIGHT`."""
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        height = min(MAX_SHOT_HEIGHT, page.evaluate("document.documentElement.scrollHeight"))
        page.screenshot(path=str(Path(SHOTS) / f"{name}.png"), full_page=True,
                        clip={"x": 0, "y": 0, "width": VIEWPORT["width"], "height": height})


def rejected(stack: Stack) -> float:
    """Requests the gateway answered with an error so far (its ``flywheel_gateway_rejected`` counter):
    also those the page's events never show, such as the browser's own ``/favicon.ico``."""
    text = httpx.get(f"{stack.gateway}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("flywheel_gateway_rejected_total{"))


def visit(watched: Watched, url: str) -> Any:
    response = watched.page.goto(url)
    assert response is not None and response.status == 200, (url, response and response.status)
    watched.page.wait_for_load_state("load")
    watched.assert_clean(url)
    return response


def test_a_tenant_key_gets_a_403_page_and_no_login(context, stack):
    watched = log_in(context, stack.keys["tenant"])
    page = watched.page
    assert page.url == f"{stack.gateway}/console/login"
    assert "admin" in page.inner_text("#login-error")
    assert [r for r in watched.failed if r.startswith("403 POST")], watched.failed
    assert not [c for c in context.cookies() if c["name"] == "flywheel_console"]
    assert page.goto("/console").url.endswith("/console/login")  # still logged out


def test_every_page_loads_without_an_error(context, stack):
    errors_before = rejected(stack)
    watched = admin(context, stack)
    page = watched.page
    cookie = next(c for c in context.cookies() if c["name"] == "flywheel_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"
    assert "flywheel_console" not in page.evaluate("document.cookie")
    stable = stack.registry().latest("stable").version

    visit(watched, "/console")
    assert page.inner_text("#stable-version").strip() == f"v{stable}"
    # The live refresh: the page's script re-fetches <main> as a fragment every 5 s.
    page.locator("#main[data-updated]").wait_for(state="attached", timeout=25_000)  # a selector: the CSP forbids eval
    assert page.inner_text("#stable-version").strip() == f"v{stable}"
    watched.assert_clean("the overview after its refresh")
    shoot(page, "overview")

    visit(watched, "/console/versions")
    versions = page.locator("#lineage tbody tr")
    assert versions.count() >= 2  # v0 and the test's candidate, and what the trainer published
    assert page.locator(f"#lineage a[href='/console/versions/{stack.candidate}']").count() >= 1
    shoot(page, "versions")

    with page.expect_navigation():
        page.click(f"#lineage tbody a[href='/console/versions/{stable}'] >> nth=0")
    watched.assert_clean(f"/console/versions/{stable}")
    assert page.locator("#audit tbody tr").count() >= 1

    visit(watched, "/console/canary")
    assert page.locator(f"form.act[data-version='{stack.candidate}']").count() == 1

    visit(watched, "/console/sessions?tenant=acme")
    assert page.locator("#sessions tbody tr").count() >= 2
    shoot(page, "sessions")

    visit(watched, "/console/sessions")
    page.fill("#session-query", stack.multi_turn)
    with page.expect_navigation():
        page.click("form.search:has(#session-query) button")
    watched.assert_clean("finding a session")
    with page.expect_navigation():
        page.click(f"#sessions a:text-is('{stack.multi_turn}')")
    watched.assert_clean("a session")
    assert page.inner_text("#session-id") == stack.multi_turn
    assert page.locator("li.turn").count() >= 2
    shoot(page, "session")
    assert rejected(stack) == errors_before, "the gateway answered a request of the walk with an error"


def test_a_script_in_a_prompt_is_shown_as_text_and_never_runs(context, stack):
    watched = admin(context, stack)
    page = watched.page
    visit(watched, f"/console/session?tenant=acme&id={stack.hostile}")
    assert page.inner_text("li.turn pre.prompt") == HOSTILE_PROMPT
    assert HOSTILE_COMMENT in page.inner_text("li.turn .feedback")
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.locator("main script, main img").count() == 0
    watched.assert_clean("the hostile session")  # no dialog fired


def test_a_form_post_without_the_csrf_token_is_refused(context, stack):
    registry = stack.registry()
    before = {v.version: v.status for v in registry.versions()}
    watched = admin(context, stack)
    page = watched.page
    visit(watched, "/console/canary")
    # The console's own page, a form built by script without the token: what a forged post looks like.
    with page.expect_navigation() as nav:
        page.evaluate("""version => {
            const form = document.createElement("form");
            form.method = "post";
            form.action = "/console/canary/promote";
            const field = document.createElement("input");
            field.name = "version"; field.value = String(version);
            form.appendChild(field);
            document.body.appendChild(form);
            form.submit();
        }""", stack.candidate)
    response = nav.value
    assert response.status == 403, response.status
    assert json.loads(response.text())["error"]["code"] == "csrf_failed"
    # Another site's page posting to the console: its SameSite=Strict cookie is not sent.
    evil = "http://evil.example/"
    page.route(evil, lambda route: route.fulfill(content_type="text/html", body=(
        f'<form method="post" action="{stack.gateway}/console/canary/promote">'
        f'<input name="version" value="{stack.candidate}"><input name="csrf_token" value="guess"></form>')))
    page.goto(evil)
    with page.expect_navigation() as nav:
        page.evaluate("document.forms[0].submit()")
    assert nav.value.status == 403
    assert json.loads(nav.value.text())["error"]["code"] == "admin_required"  # no cookie came with it
    assert {v.version: v.status for v in registry.versions()} == before


def test_promote_from_the_canary_page_moves_the_version_and_is_audited(context, stack):
    registry = stack.registry()
    candidate = stack.candidate
    assert registry.get(candidate).status == "candidate"
    watched = admin(context, stack)
    page = watched.page
    visit(watched, "/console/canary")
    form = page.locator(f"form.act[data-version='{candidate}']")
    form.locator("input[name=reason]").fill(REASON)
    with page.expect_navigation():
        form.locator("button[value=promote]").click()
    assert "/console/canary?ok=" in page.url, page.url
    watched.assert_clean("the promote")
    assert f"promote v{candidate}: v{candidate} stable" in page.inner_text("#flash")
    assert registry.get(candidate).status == "stable"
    assert page.inner_text("#stable-version").strip() == f"v{candidate}"
    shoot(page, "canary")

    visit(watched, "/console/versions")
    row = page.locator("#lineage tbody tr", has=page.locator(f"td:first-child a[href='/console/versions/{candidate}']"))
    assert REASON in row.locator("td.reason").inner_text()
    visit(watched, f"/console/versions/{candidate}")
    audit = page.inner_text("#audit")
    assert REASON in audit and "manual promote" in audit
    shoot(page, "version")

    # The node loads the promoted weights and new sessions are served by them.
    def served_by() -> int:
        r = httpx.post(f"{stack.gateway}/v1/chat/completions", timeout=30,
                       headers={"Authorization": f"Bearer {stack.keys['tenant']}",
                                "X-Flywheel-Session": f"after-{random.getrandbits(32):x}"},
                       json={"model": stack.settings.model.line, "max_tokens": 2,
                             "messages": [{"role": "user", "content": "sort: c a b"}]})
        return r.status_code == 200 and int(r.headers["X-Flywheel-Model-Version"]) == candidate

    wait_until(f"new sessions to be served by v{candidate}", served_by, timeout_s=30, every_s=0.5)
    assert registry.transitions(candidate)[-1]["reason"].endswith(f": {REASON}")  # kept as typed, escaped only on pages
