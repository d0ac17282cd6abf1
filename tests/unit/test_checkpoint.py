"""The trainer checkpoint: bit-exact round trips of weights, Adam and schedule, buffer and offsets."""

from __future__ import annotations

import hashlib
import random
import shutil
from pathlib import Path

import pytest
import torch

from flywheel.bus.base import Record
from flywheel.events import ScoredTrajectory, Segment, Turn
from trainer import checkpoint
from trainer.buffer import OffsetTracker, SampleBuffer

pytestmark = pytest.mark.unit


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().reshape(-1).contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def moments(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return moments_of(optimizer.state_dict())


def moments_of(state: dict) -> dict[str, torch.Tensor]:
    """Adam's per-parameter state (step, exp_avg, exp_avg_sq) as flat named tensors."""
    return {f"{i}.{k}": torch.as_tensor(v) for i, s in state["state"].items() for k, v in s.items()}


def sample(tid: str, *, revision: int = 0, version: int = 0) -> ScoredTrajectory:
    seg = Segment(tokens=[1, 2, 3], mask=[0, 1, 1], logprobs=[0.0, -0.5, -1.5],
                  turns=[Turn(generation_id=f"g-{tid}", start=1, end=3, behaviour_version=version)])
    return ScoredTrajectory(event_id=f"{tid}-r{revision}", tenant="t", session_id=tid, trajectory_id=tid,
                            revision=revision, model_line="m", segments=[seg], turn_rewards=[1.0], total_reward=1.0,
                            reward_spec_version="x")


def setup(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 5))
    return model, opt, sched


def steps(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LambdaLR,
          inputs: list[torch.Tensor]) -> None:
    for x in inputs:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        sched.step()


def make_checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LambdaLR,
                    step: int, buffer: SampleBuffer | None = None, offsets: OffsetTracker | None = None,
                    line: str = "m") -> checkpoint.Checkpoint:
    return checkpoint.Checkpoint(
        model_line=line, step=step, parent=3, parent_sha256="ab" * 32, publish_token="tok",
        metrics={"loss": 0.5, "trajectory_ids": ["a", "b"]},
        model={n: p.detach().clone() for n, p in model.named_parameters()},
        optimizer=opt.state_dict(), scheduler=sched.state_dict(),
        buffer=(buffer or SampleBuffer(4)).state_dict(), offsets=(offsets or OffsetTracker()).state_dict(),
    )


def test_weights_adam_and_schedule_round_trip_bit_exact_and_resume_identically(tmp_path: Path) -> None:
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(4, 7, generator=gen) for _ in range(8)]

    straight, s_opt, s_sched = setup(seed)  # eight steps without interruption
    steps(straight, s_opt, s_sched, inputs)

    model, opt, sched = setup(seed)  # three steps, checkpoint, "crash", restore, five steps
    steps(model, opt, sched, inputs[:3])
    path = checkpoint.save(tmp_path, make_checkpoint(model, opt, sched, step=3))
    assert path.name == "step-0000000003.pt" and not list(tmp_path.glob(".*"))
    loaded = checkpoint.load_latest(tmp_path, "m")
    assert loaded is not None
    assert digest(loaded.model) == digest(dict(model.named_parameters()))
    assert len(moments(opt)) == 12  # step, exp_avg, exp_avg_sq for each of 4 parameters
    assert digest(moments(opt)) == digest(moments_of(loaded.optimizer))
    assert loaded.optimizer["param_groups"] == opt.state_dict()["param_groups"]
    assert loaded.scheduler == sched.state_dict()
    assert (loaded.step, loaded.parent, loaded.publish_token, loaded.metrics["trajectory_ids"]) == (3, 3, "tok", ["a", "b"])

    fresh, f_opt, f_sched = setup(seed + 1)  # different initial weights: everything must come from the file
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            p.copy_(loaded.model[name])
    f_opt.load_state_dict(loaded.optimizer)
    f_sched.load_state_dict(loaded.scheduler)
    steps(fresh, f_opt, f_sched, inputs[3:])
    assert digest(dict(fresh.named_parameters())) == digest(dict(straight.named_parameters()))
    assert digest(moments(f_opt)) == digest(moments(s_opt))


def test_buffer_and_offsets_resume_as_saved(tmp_path: Path) -> None:
    buf, tracker = SampleBuffer(max_staleness=4), OffsetTracker()
    records = [Record("scored", 0, o, f"k{o}", sample(t, revision=r).to_bytes())
               for o, (t, r) in enumerate([("a", 0), ("b", 0), ("c", 0), ("a", 1), ("d", 0)])]
    records.append(Record("scored", 0, 5, "k5", records[1].value))  # "b" delivered twice: a duplicate
    for record in records:
        assert tracker.track(record)
        if buf.add(ScoredTrajectory.from_bytes(record.value), record, current_version=0) is not None:
            tracker.done(record)
    for entry in buf.purge_stale(0):  # a0 was superseded by a1
        tracker.done(entry.record)
    taken = buf.take(2)
    assert [e.sample.trajectory_id for e in taken] == ["b", "c"]
    for entry in taken:
        tracker.done(entry.record)
    assert [r.offset for r in tracker.committable()] == [2]  # offsets 0..2 done; a1 (3) waits
    model, opt, sched = setup(0)
    checkpoint.save(tmp_path, make_checkpoint(model, opt, sched, step=1, buffer=buf, offsets=tracker))

    loaded = checkpoint.load_latest(tmp_path, "m")
    assert loaded is not None
    buf2, tracker2 = SampleBuffer(max_staleness=4), OffsetTracker()
    buf2.load_state_dict(loaded.buffer)
    tracker2.load_state_dict(loaded.offsets)
    assert buf2.counters() == buf.counters() and buf2.state_dict() == buf.state_dict()
    # The bus redelivers everything after its committed offset (say nothing was committed): all seen before.
    assert [tracker2.track(r) for r in records] == [False] * 6
    assert buf2.add(sample("b"), None, 0) == "duplicate"  # the de-dup memories came back
    assert buf2.add(sample("c", revision=1), None, 0) == "already_trained"
    new = Record("scored", 0, 6, "k6", sample("e").to_bytes())
    assert tracker2.track(new) and buf2.add(sample("e"), new, 0) is None
    batch = buf2.take(3)
    assert [(e.sample.trajectory_id, e.sample.revision, e.record.offset) for e in batch] == [
        ("a", 1, 3), ("d", 0, 4), ("e", 0, 6)]
    for entry in batch:
        tracker2.done(entry.record)
    assert [r.offset for r in tracker2.committable()] == [6]  # 0..2 again (done before), then 3..6


def test_newest_wins_old_ones_pruned_temporaries_ignored_and_bad_files_refused(tmp_path: Path) -> None:
    model, opt, sched = setup(1)
    for step in (2, 4, 6):
        checkpoint.save(tmp_path, make_checkpoint(model, opt, sched, step=step), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000000004.pt", "step-0000000006.pt"]
    (tmp_path / ".step-0000000008.pt.123.tmp").write_bytes(b"half a checkpoint")  # a save killed midway
    loaded = checkpoint.load_latest(tmp_path, "m")
    assert loaded is not None and loaded.step == 6
    assert not list(tmp_path.glob(".*"))
    assert checkpoint.load_latest(tmp_path / "none", "m") is None
    with pytest.raises(checkpoint.CheckpointError, match="model line 'm', not 'other'"):
        checkpoint.load_latest(tmp_path, "other")
    (tmp_path / "step-0000000008.pt").write_bytes(b"\x00" * 64)  # never fall back to an older one
    with pytest.raises(checkpoint.CheckpointError, match="step-0000000008.pt"):
        checkpoint.load_latest(tmp_path, "m")


def test_a_sharded_checkpoint_round_trips_and_a_crash_before_its_file_leaves_no_trace(tmp_path: Path) -> None:
    """``save_sharded`` in one process (DCP without a process group: what a 1-rank resume of a
    sharded job reads): weights, Adam and schedule come back bit-exact from the folder the file
    names; a folder no file names (a crash before the commit point) is never loaded and goes."""
    from trainer.distributed import Dist

    dist = Dist()
    model, opt, sched = setup(5)
    steps(model, opt, sched, [torch.randn(4, 7, generator=torch.Generator().manual_seed(i)) for i in range(3)])
    point = make_checkpoint(model, opt, sched, step=3)
    point.model, point.optimizer = {}, {}
    path = checkpoint.save_sharded(dist, tmp_path, model, opt, point)
    assert path.name == "step-0000000003.pt" and (tmp_path / "step-0000000003.dcp" / ".metadata").is_file()
    (tmp_path / ".step-0000000004.dcp.tmp").mkdir()  # killed while the ranks wrote their shards
    (tmp_path / "step-0000000004.dcp").mkdir()  # killed after the rename, before the file
    loaded = checkpoint.load_latest(tmp_path, "m")
    assert loaded is not None and loaded.step == 3 and loaded.sharded == "step-0000000003.dcp"
    assert loaded.model == {} and loaded.optimizer == {} and loaded.scheduler == sched.state_dict()
    assert not (tmp_path / ".step-0000000004.dcp.tmp").exists()

    fresh, f_opt, _ = setup(6)  # other weights and no Adam state yet: everything comes from the shards
    checkpoint.load_sharded(dist, tmp_path, fresh, f_opt, loaded)
    assert digest(dict(fresh.named_parameters())) == digest(dict(model.named_parameters()))
    assert digest(moments(f_opt)) == digest(moments(opt))

    point = make_checkpoint(model, opt, sched, step=5)  # the next save rotates: orphans and old folders go
    point.model, point.optimizer = {}, {}
    checkpoint.save_sharded(dist, tmp_path, model, opt, point, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000000005.dcp", "step-0000000005.pt"]
    shutil.rmtree(tmp_path / "step-0000000005.dcp")  # a file whose shards are gone is refused, never skipped
    with pytest.raises(checkpoint.CheckpointError, match="step-0000000005.dcp"):
        checkpoint.load_latest(tmp_path, "m")
