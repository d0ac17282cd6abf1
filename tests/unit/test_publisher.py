"""The background publisher: snapshots that later steps cannot change, checkpoint then publish in
order one point at a time, submit blocking only on the previous point, worker failures re-raised in
the caller, inline mode; and a version's parity resolved for its parent at the next cut."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.settings import load_settings
from flywheel.weights.codec.state import state_sha256
from flywheel.weights.registry import Registry, State
from flywheel.weights.store import make_store
from trainer import checkpoint
from trainer.publisher import Publisher, snapshot

pytestmark = pytest.mark.unit


def registry_at(tmp_path: Path) -> tuple[Registry, State]:
    """A fresh SQLite + folder registry with a random v0; returns it and v0's weights."""
    settings = load_settings(None, data_dir=str(tmp_path / "data"))
    upgrade(settings.database_url)
    registry = Registry(make_session_factory(make_engine(settings.database_url)), make_store(settings), "m")
    v0 = weights(torch.Generator().manual_seed(0))
    registry.ensure_base(v0, reason="test")
    return registry, v0


def weights(g: torch.Generator) -> State:
    return {"a.weight": torch.randn(8, 16, generator=g).bfloat16(), "b.bias": torch.randn(16, generator=g).bfloat16()}


def wait_until(check: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def point(step: int, parent: int, registry: Registry, g: torch.Generator) -> tuple[checkpoint.Checkpoint, State]:
    export = weights(g)
    ckpt = checkpoint.Checkpoint(
        model_line="m", step=step, parent=parent, parent_sha256=registry.get(parent).sha256,
        publish_token=f"token-{step}", metrics={"loss": float(step), "trajectory_ids": [f"t{step}"]},
        model={k: v.float() for k, v in export.items()}, optimizer={}, scheduler={}, buffer={}, offsets={},
    )
    return ckpt, export


class Gated(Registry):
    """The real registry whose publish waits for ``gate`` (a slow upload), or fails when told."""

    gate = threading.Event()
    fail: BaseException | None = None

    def publish(self, state: State, **kw: Any) -> Any:  # type: ignore[override]
        assert self.gate.wait(30)
        if self.fail is not None:
            raise self.fail
        return super().publish(state, **kw)


def gated(registry: Registry) -> Gated:
    out = Gated(registry.sessions, registry.store, registry.model_line)
    out.gate, out.fail = threading.Event(), None
    return out


def test_background_points_are_checkpointed_then_published_in_order_with_their_weights(tmp_path: Path) -> None:
    registry, parent_state = registry_at(tmp_path)
    slow = gated(registry)
    publisher = Publisher(slow, tmp_path / "ckpt", keep=2)
    g = torch.Generator().manual_seed(1)
    parent, hashes = 0, []
    for step in (1, 2, 3):
        ckpt, export = point(step, parent, registry, g)
        publisher.submit(ckpt, export, parent_state)  # returns at once: nothing was pending
        assert publisher.done() is None  # the upload is held at the gate
        wait_until(lambda: (tmp_path / "ckpt" / f"step-{step:010d}.pt").exists())  # the checkpoint comes first
        assert registry.latest().version == parent  # type: ignore[union-attr]
        slow.gate.set()
        info = publisher.wait()
        slow.gate.clear()
        assert info is not None and info.version == parent + 1 and info.parent == parent and info.train_step == step
        assert info.metrics["publish_token"] == f"token-{step}" and info.metrics["trajectory_ids"] == [f"t{step}"]
        assert publisher.done() is None and publisher.wait() is None  # each version is reported once
        hashes.append(info.sha256)
        assert info.sha256 == state_sha256(export)
        parent, parent_state = info.version, export
    publisher.close()
    assert publisher.versions == 3
    assert [v.sha256 for v in registry.versions()[1:]] == hashes
    # The checkpoint was written first, and names the version published from it.
    newest = checkpoint.load_latest(tmp_path / "ckpt", "m")
    assert newest is not None and newest.step == 3
    assert checkpoint.find_published(registry, newest).version == 3  # type: ignore[union-attr]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-0000000002.pt", "step-0000000003.pt"]


def test_submit_blocks_only_while_the_previous_point_is_written(tmp_path: Path) -> None:
    registry, v0 = registry_at(tmp_path)
    slow = gated(registry)
    publisher = Publisher(slow, tmp_path / "ckpt", keep=2)
    g = torch.Generator().manual_seed(2)
    first, first_export = point(1, 0, registry, g)
    started = time.monotonic()
    publisher.submit(first, first_export, v0)
    assert time.monotonic() - started < 1.0 and publisher.stall_s < 1.0
    # The checkpoint is on disk before the version exists (the crash-window order).
    wait_until(lambda: (tmp_path / "ckpt" / "step-0000000001.pt").exists())
    assert registry.latest().version == 0  # type: ignore[union-attr]

    second, second_export = point(2, 0, registry, g)  # (a caller that did not wait: parent v0 again)
    returned = threading.Event()
    thread = threading.Thread(target=lambda: (publisher.submit(second, second_export, v0), returned.set()))
    thread.start()
    assert not returned.wait(0.5)  # the first point is still being written
    threading.Timer(0.3, slow.gate.set).start()
    assert returned.wait(10)
    thread.join()
    assert publisher.stall_s >= 0.5
    info = publisher.wait()  # both done; the newest is reported (the first was never collected)
    publisher.close()
    assert info is not None and info.version == 2 and info.train_step == 2 and publisher.versions == 2
    assert registry.get(1).train_step == 1


def test_a_worker_failure_is_re_raised_in_the_caller_and_stops_the_publisher(tmp_path: Path) -> None:
    registry, v0 = registry_at(tmp_path)
    slow = gated(registry)
    slow.fail = RuntimeError("store unreachable")
    publisher = Publisher(slow, tmp_path / "ckpt", keep=2)
    g = torch.Generator().manual_seed(3)
    ckpt, export = point(1, 0, registry, g)
    publisher.submit(ckpt, export, v0)
    assert publisher.done() is None
    slow.gate.set()
    with pytest.raises(RuntimeError, match="store unreachable"):
        publisher.wait()
    with pytest.raises(RuntimeError, match="store unreachable"):
        publisher.done()
    with pytest.raises(RuntimeError, match="store unreachable"):
        publisher.submit(*point(2, 0, registry, g), v0)
    publisher.close()  # returns: the failure stays in .error
    assert isinstance(publisher.error, RuntimeError) and registry.latest().version == 0  # type: ignore[union-attr]
    assert (tmp_path / "ckpt" / "step-0000000001.pt").exists()  # the restart publishes it (trainer.checkpoint)


def test_inline_mode_does_the_whole_work_in_submit_and_counts_it_as_the_stall(tmp_path: Path) -> None:
    registry, v0 = registry_at(tmp_path)
    publisher = Publisher(registry, tmp_path / "ckpt", keep=2, background=False)
    ckpt, export = point(1, 0, registry, torch.Generator().manual_seed(4))
    publisher.submit(ckpt, export, v0)
    assert registry.latest().version == 1 and publisher.stall_s > 0  # type: ignore[union-attr]
    info = publisher.done()
    assert info is not None and info.version == 1 and publisher.done() is None and publisher.wait() is None
    failing = gated(registry)
    failing.gate.set()
    failing.fail = ValueError("bad")
    inline = Publisher(failing, tmp_path / "ckpt", keep=2, background=False)
    with pytest.raises(ValueError, match="bad"):  # raised where today's inline publish raised
        inline.submit(*point(2, 1, registry, torch.Generator().manual_seed(5)), export)
    inline.close()
    publisher.close()


def test_snapshot_copies_what_later_steps_would_change_and_nothing_else() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(6, 5)).pow(2).mean().backward()
        optimizer.step()

    step()
    fresh_master = {n: p.detach().clone() for n, p in model.named_parameters()}  # Dist.full_state_dict in one process
    live_master = {n: p.detach() for n, p in model.named_parameters()}  # aliases the parameters
    export = {n: p.detach().bfloat16() for n, p in model.named_parameters()}
    live_optimizer = optimizer.state_dict()  # the live Adam moments and step counters
    expected = {i: {k: v.clone() for k, v in s.items()} for i, s in live_optimizer["state"].items()}
    master_hash = state_sha256(fresh_master)

    point = snapshot({**fresh_master, **{f"live.{n}": t for n, t in live_master.items()}}, live_optimizer, export,
                     live=(model, optimizer))
    assert all(point.master[n] is t for n, t in fresh_master.items())  # fresh already: not copied again
    assert all(point.export[n] is t for n, t in export.items())
    assert all(point.master[f"live.{n}"] is not t for n, t in live_master.items())
    step()
    step()
    for i, state in expected.items():  # Adam moved on; the snapshot did not
        assert not torch.equal(live_optimizer["state"][i]["exp_avg"], state["exp_avg"])
        for key, value in state.items():
            assert torch.equal(point.optimizer["state"][i][key], value), (i, key)
    assert point.optimizer["param_groups"] == live_optimizer["param_groups"]
    assert state_sha256({n: point.master[f"live.{n}"] for n in live_master}) == master_hash
    assert state_sha256({n: point.master[n] for n in fresh_master}) == master_hash

    # Without ``live`` nothing can be told apart: every tensor is copied.
    blind = snapshot(fresh_master, {"state": {}, "param_groups": []}, export)
    assert all(blind.master[n] is not t and torch.equal(blind.master[n], t) for n, t in fresh_master.items())
    assert all(blind.export[n] is not t for n, t in export.items())


def test_a_versions_parity_is_its_parents_entry_whatever_the_loop_knew_at_step_time() -> None:
    from trainer.train import summarise

    def stats(x: float) -> dict[str, float]:
        return {"parity": x, "parity_p99": 2 * x, "parity_max": 3 * x}

    base = {"loss": 1.0, "samples": 4.0, "tokens": 10.0, "staleness": {"0": 4}}
    # Background: the window's first step ran while v4 was still being published (current was 3);
    # the window's master started from v4, the new version's parent.
    background = [{**base, **stats(0.5), "parity_by_version": {"3": stats(0.5), "4": stats(0.01)}}, dict(base)]
    # Inline: the same step with v4 already current (top level = v4's entry).
    inline = [{**base, **stats(0.01), "parity_by_version": {"3": stats(0.5), "4": stats(0.01)}}, dict(base)]
    for window in (background, inline):
        out = summarise(window, {"buffered": 0}, 4)
        assert (out["parity"], out["parity_p99"], out["parity_max"]) == (0.01, 0.02, 0.03)
        assert "parity_by_version" not in out and out["steps"] == 2 and out["samples"] == 8
    nothing_served_by_parent = summarise([{**base, "parity_by_version": {"3": stats(0.5)}}], {}, 4)
    assert "parity" not in nothing_served_by_parent and "parity_max" not in nothing_served_by_parent
