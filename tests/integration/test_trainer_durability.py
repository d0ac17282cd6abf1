"""kill -9 the trainer at a random moment and restart it: nothing lost, nothing trained twice, no
version number reused.

The trainer runs as a real process (``python -m launch.cli --config settings.json trainer``) on a
local-log bus and SQLite under ``tmp_path``, with the quick tiny model. The scored trajectories are
real: token ids and logprobs sampled from that model, sent as ScoredTrajectory events, among them
redelivered duplicates, late revisions and one undecodable record. The random kill lands in any
crash window (trainer/checkpoint.py); the two windows around the registry insert are also hit on
purpose, in process, by a publish that dies just before or just after its row is written.

Publishing runs in the background by default (``trainer.publish_in_background``,
trainer/publisher.py), so the random kills mostly land while a checkpoint write or a publish is in
flight in the worker thread and the next step trains, and the injected crashes are raised in that
worker and surface in the loop; the ``full_inline`` variant publishes inline in one process, which
streams the live model (``trainer.sharded_versions``: a DCP checkpoint and one-shard versions), and
kills that. The
``sharded_2_ranks`` variant runs the trainer under torchrun with 2 gloo ranks (FSDP2), each rank
checkpointing and publishing its own shard (``trainer.sharded_versions``), and kills the whole job
(torchrun and both ranks) with -9, as a lost host would be. The last test checks that a version
published in the background names exactly the weights of the step it was cut at.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flywheel.bus import make_bus
from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.events import ScoredTrajectory, Segment, Turn, new_id
from flywheel.settings import Settings, load_settings
from flywheel.weights.registry import Registry
from flywheel.weights.store import make_store

pytestmark = pytest.mark.integration

BATCH = 4
N_TRAJECTORIES = 64  # 16 versions of one 4-sample step each
REPO = Path(__file__).resolve().parents[2]


def scored_trajectories(model_dir: Path, n: int, seed: int) -> list[ScoredTrajectory]:
    """``n`` single-turn trajectories served by version 0 of the quick model, rewarded at random."""
    from demo.tinymodel.task import traffic_problem, user_message
    from flywheel.lm import chat_prompt_ids, generate, load_model

    model, tok = load_model(model_dir)
    rng = random.Random(seed)
    problems = [traffic_problem(rng) for _ in range(n // 2)]
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": user_message(p)}]) for p in problems for _ in (0, 1)]
    out = []
    for i, (prompt, sample) in enumerate(zip(prompts, generate(model, prompts, max_new_tokens=6, seed=seed,
                                                               eos_token_id=tok.eos_token_id), strict=True)):
        tokens = prompt + sample.token_ids
        segment = Segment(
            tokens=tokens, mask=[0] * len(prompt) + [1] * len(sample.token_ids),
            logprobs=[0.0] * len(prompt) + sample.logprobs,
            turns=[Turn(generation_id=new_id(), start=len(prompt), end=len(tokens), behaviour_version=0)],
        )
        reward = rng.choice([-1.0, 1.0])
        out.append(ScoredTrajectory(
            tenant="acme", session_id=f"s-{i}", trajectory_id=f"traj-{i:03d}-{new_id()[:6]}", model_line="tiny-sim",
            segments=[segment], turn_rewards=[reward], total_reward=reward, reward_spec_version="test",
            prompt_key=f"p-{i // 2}",
        ))
    return out


@pytest.fixture(scope="module")
def samples(tiny_model_dir: Path) -> list[ScoredTrajectory]:
    return scored_trajectories(tiny_model_dir, N_TRAJECTORIES, seed=random.randrange(2**31))


#: The trainer variants the kill test runs: full-parameter; LoRA with a KL term to the base model
#: and micro-batches small enough that every step accumulates gradients over several passes; LoRA
#: publishing adapter versions (on an empty registry, which the trainer seeds with the zero adapter);
#: full-parameter publishing inline, at the cut (the others publish in the background).
VARIANTS = {
    "full": {},
    "full_inline": {"publish_in_background": False},
    "lora_kl_microbatched": {"lora_rank": 4, "kl_coef": 0.05, "micro_batch_tokens": 64},
    "lora_adapter": {"lora_rank": 4, "lora_publish": "adapter"},
    "sharded_2_ranks": {},
}
#: Variants run under torchrun (the rest in one process).
TORCHRUN = {"sharded_2_ranks": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]}
#: Variants whose checkpoints and versions are sharded (one shard in one process).
SHARDED = {"sharded_2_ranks", "full_inline"}


def make_settings(tmp_path: Path, db_url: str, model_dir: Path, **trainer: Any) -> Settings:
    return load_settings(
        None,
        data_dir=str(tmp_path / "data"),
        db={"url": db_url, "wait_s": 10},
        model={"path": str(model_dir)},
        bus={"partitions": 2},
        # The scored records are made here, not by a rewards worker: none is in scored_trajectories.
        trainer={"batch_size": BATCH, "steps_per_version": 1, "lr": 1e-3, "max_staleness": 1000,
                 "require_stored": False, **trainer},
    )


def registry_for(settings: Settings) -> Registry:
    """The line's registry, with the base model registered as stable v0 (what the node does at start);
    an adapter line is left empty: the trainer registers the zero adapter itself."""
    from flywheel.lm import export_state, load_model

    upgrade(settings.database_url)
    registry = Registry(make_session_factory(make_engine(settings.database_url)), make_store(settings),
                        settings.model.line)
    if settings.trainer.lora_publish != "adapter":
        registry.ensure_base(export_state(load_model(settings.model.path)[0]), reason="test: base model")
    return registry


def assert_one_chain_each_trajectory_once(registry: Registry, samples: list[ScoredTrajectory], context: Any) -> None:
    """Versions 0..N, contiguous, each trained from the previous; every trajectory in exactly one version."""
    versions = registry.versions()
    assert [v.version for v in versions] == list(range(1 + len(samples) // BATCH)), context
    assert all(v.parent == v.version - 1 and v.train_step == v.version for v in versions[1:]), context
    assert Counter(trained_ids(registry)) == Counter({s.trajectory_id: 1 for s in samples}), context


def send(settings: Settings, values: list[bytes]) -> None:
    bus = make_bus(settings)
    producer = bus.producer()
    for value in values:
        producer.send(settings.topic("scored"), new_id(), value)
    producer.close()
    bus.close()


def kill_9(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the trainer and, under torchrun, its ranks (each in a session of its own)."""
    children = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == proc.pid:
                children.append(int(entry.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    for pid in (proc.pid, *children):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_trainer(config: Path, log_path: Path, launcher: list[str] | None = None) -> subprocess.Popen[bytes]:
    """The trainer (under ``launcher``, e.g. torchrun, when given)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    with open(log_path, "ab") as out:
        return subprocess.Popen([sys.executable, *(launcher or []), "-m", "launch.cli", "--config", str(config), "trainer"],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)


def wait_for(what: str, check: Callable[[], bool], proc: subprocess.Popen[bytes], log_path: Path,
             timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text()[-4000:]
            raise AssertionError(f"waiting for {what}: trainer exited {proc.returncode} or timed out; log:\n{tail}")
        time.sleep(0.05)


def trained_ids(registry: Registry) -> list[str]:
    return [tid for v in registry.versions() for tid in v.metrics.get("trajectory_ids", [])]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kill_9_at_a_random_moment_then_restart_loses_and_repeats_nothing(
    tmp_path: Path, sqlite_url: str, tiny_model_dir: Path, samples: list[ScoredTrajectory], variant: str
) -> None:
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    settings = make_settings(tmp_path, sqlite_url, tiny_model_dir, **VARIANTS[variant])
    config = tmp_path / "settings.json"
    config.write_text(json.dumps(settings.model_dump(mode="json")))
    registry = registry_for(settings)

    duplicates = [s.to_bytes() for s in rng.sample(samples, 6)]  # the same event delivered again
    revisions = [s.model_copy(update={"event_id": new_id(), "revision": 1}).to_bytes() for s in rng.sample(samples, 4)]
    first, second = samples[:40], samples[40:]
    send(settings, [b"{ not json"] + [s.to_bytes() for s in first] + duplicates[:3] + revisions[:2])

    log_path = tmp_path / "trainer.log"
    launcher = TORCHRUN.get(variant)
    proc = start_trainer(config, log_path, launcher)
    kill_after = rng.randint(2, 7)
    latest = lambda: getattr(registry.latest(), "version", -1)  # noqa: E731
    wait_for(f"v{kill_after}", lambda: latest() >= kill_after, proc, log_path, timeout_s=240 if launcher else 150)
    time.sleep(rng.uniform(0.0, 0.6))  # anywhere in a step, a checkpoint write, a publish or a commit
    kill_9(proc)  # the trainer, or torchrun and every rank
    assert proc.wait(10) == -signal.SIGKILL
    context = {"seed": seed, "killed_at": latest(), "variant": variant}

    send(settings, [s.to_bytes() for s in second] + duplicates[3:] + revisions[2:])
    proc = start_trainer(config, log_path, launcher)
    try:
        wait_for("every trajectory trained", lambda: len(trained_ids(registry)) >= N_TRAJECTORIES, proc, log_path,
                 timeout_s=300 if launcher else 180)
        time.sleep(1.0)  # long enough for a wrongly repeated version to show up
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    log = log_path.read_text()
    # torchrun passes SIGTERM to the ranks, which stop cleanly, and exits 1 itself.
    assert code == (1 if launcher else 0), log[-4000:]
    assert "resumed from checkpoint" in log and "trainer stopping at step" in log, log[-4000:]
    if variant in SHARDED:  # every version after v0 and every checkpoint sharded: no rank gathered a state
        assert all(v.store_key.endswith(".manifest") for v in registry.versions()[1:]), context
        checkpoints = list((settings.data_path / "trainer" / settings.model.line).iterdir())
        assert any(p.name.endswith(".dcp") for p in checkpoints), (context, checkpoints)

    # No version number reused or skipped, one linear chain; every trajectory trained exactly once.
    assert_one_chain_each_trajectory_once(registry, samples, context)
    # Nothing lost: every event fed was taken or dropped with a reason (dead-lettered included), counted once.
    metrics = registry.versions()[-1].metrics
    dropped = {k: v for k, v in metrics.items() if k.startswith("dropped_")}
    assert metrics["taken"] == N_TRAJECTORIES and metrics["buffered"] == 0, context
    assert dropped.get("dropped_duplicate") == len(duplicates), context
    assert dropped.get("dropped_superseded", 0) + dropped.get("dropped_already_trained", 0) == len(revisions), context
    assert dropped.get("dropped_dead_lettered") == 1, context  # the undecodable record, counted once across the kill
    assert metrics["taken"] + sum(dropped.values()) == N_TRAJECTORIES + len(duplicates) + len(revisions) + 1, context
    assert read_dlq(settings) == [b"{ not json"]
    # The versions changed the weights (LoRA ones through their merged export; a single step may
    # not: its batch can have all-zero advantages, and a LoRA's first steps move little) and carry
    # the step's metrics: the staleness histogram, and parity (every sample was served by v0, so on
    # v1's first step the master equals the serving weights).
    assert any(v.fraction_changed for v in registry.versions()[1:]), context
    v1 = registry.get(1)
    assert v1.metrics["staleness"] == {"0": BATCH}, context
    assert 0 <= v1.metrics["parity"] <= v1.metrics["parity_p99"] <= v1.metrics["parity_max"] < 0.5, context
    assert sum(sum(v.metrics["staleness"].values()) for v in registry.versions()[1:]) == N_TRAJECTORIES, context
    if "kl_coef" in VARIANTS[variant]:
        assert any(v.metrics.get("kl", 0) > 0 for v in registry.versions()[2:]), context
    if VARIANTS[variant].get("lora_publish") == "adapter":  # adapter versions from the zero adapter on
        v0 = registry.load(0)
        assert v0 and all(".lora_A." in k or ".lora_B." in k for k in v0), context
        assert all(not t.any() for k, t in v0.items() if ".lora_B." in k), context
        assert registry.load(registry.latest().version).keys() == v0.keys(), context  # type: ignore[union-attr]
    if variant in SHARDED:
        # The job restarted with sharded versions off: it resumes the sharded checkpoint and publishes
        # gathered. Then on again: every rank reads its own rows of the gathered checkpoint's weights
        # (the version published from it checked against the ranks' shards) and publishes shards.
        # One process does the same between its streamed and its gathered inline points.
        gathered = settings.model_copy(update={"trainer": settings.trainer.model_copy(update={"sharded_versions": False})})
        for round_no, (run, manifest) in enumerate(((gathered, False), (settings, True)), start=1):
            config.write_text(json.dumps(run.model_dump(mode="json")))
            more = scored_trajectories(tiny_model_dir, BATCH, seed=seed + round_no)
            send(settings, [s.to_bytes() for s in more])
            last = registry.latest().version  # type: ignore[union-attr]
            proc = start_trainer(config, log_path, launcher)
            try:
                wait_for(f"a version after v{last}", lambda: latest() > last, proc, log_path, timeout_s=120)
            finally:
                proc.send_signal(signal.SIGTERM)
                code = proc.wait(60)
            assert code == (1 if launcher else 0), log_path.read_text()[-4000:]
            new = registry.get(last + 1)
            assert new.store_key.endswith(".manifest") == manifest and new.parent == last, (context, new)
            assert sorted(new.metrics["trajectory_ids"]) == sorted(s.trajectory_id for s in more), (context, new)
            assert registry.load(new.version) is not None  # a node rebuilds it on the chain, every hash checked
        from trainer.checkpoint import checkpoint_dir
        from trainer.train import START_FILE

        assert not (checkpoint_dir(settings) / START_FILE).exists(), context  # read by every rank, then removed


class Crash(Exception):
    """Stands for the process dying at the injection point."""


@pytest.mark.parametrize("window", ["before_row", "after_row"])
def test_a_crash_on_either_side_of_the_registry_insert_publishes_the_checkpoint_once(
    tmp_path: Path, sqlite_url: str, tiny_model_dir: Path, samples: list[ScoredTrajectory],
    monkeypatch: pytest.MonkeyPatch, window: str,
) -> None:
    from trainer.train import train

    settings = make_settings(tmp_path, sqlite_url, tiny_model_dir)
    registry = registry_for(settings)
    part = samples[:24]
    send(settings, [s.to_bytes() for s in part])

    real_publish = Registry.publish
    publishes: list[int] = []

    def dies_at_the_third(self: Registry, state: Any, **kw: Any) -> Any:
        publishes.append(1)
        if len(publishes) != 3:
            return real_publish(self, state, **kw)
        if window == "after_row":
            real_publish(self, state, **kw)  # the row is in; the process dies before the commit
        raise Crash(window)

    monkeypatch.setattr(Registry, "publish", dies_at_the_third)
    give_up = threading.Event()
    timer = threading.Timer(60, give_up.set)  # without the crash, train() would wait for data forever
    timer.start()
    with pytest.raises(Crash):
        train(settings, give_up)  # ends by the crash at the third publish (every sample is there)
    timer.cancel()
    assert registry.latest().version == (3 if window == "after_row" else 2)  # type: ignore[union-attr]

    stop, errors = threading.Event(), []
    thread = threading.Thread(target=lambda: run_or_record(train, settings, stop, errors), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while len(trained_ids(registry)) < len(part) and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.1)
    time.sleep(0.5)
    stop.set()
    thread.join(30)
    assert not errors and not thread.is_alive()
    assert len(publishes) == 1 + len(part) // BATCH - (window == "after_row")  # adopted, not published again
    assert_one_chain_each_trajectory_once(registry, part, window)


def run_or_record(role: Callable[..., None], settings: Settings, stop: threading.Event, errors: list[BaseException]) -> None:
    try:
        role(settings, stop)
    except BaseException as exc:  # reported in the test thread
        errors.append(exc)


def read_dlq(settings: Settings) -> list[bytes]:
    bus = make_bus(settings)
    consumer = bus.consumer("t-dlq", [settings.topic("scored") + ".dlq"])
    out: list[bytes] = []
    try:
        for _ in range(5):
            out += [r.value for r in consumer.poll(timeout_s=0.2, max_records=100)]
    finally:
        consumer.close()
        bus.close()
    return out



def test_each_version_names_the_weights_of_its_step_while_later_steps_train(
    tmp_path: Path, sqlite_url: str, tiny_model_dir: Path, samples: list[ScoredTrajectory],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One version per step, each publish slowed down: every version's hash is the bf16 export of
    the master right after its step, although in the background the next step trained while it was
    being written; inline and background publishing give the same versions and metrics (but for
    ``staleness``, which in the background counts against the version the loop knew: one behind
    for the first step after a cut)."""
    import trainer.train as recipe
    from flywheel.lm import export_state
    from flywheel.weights.codec.state import state_sha256

    after_step: dict[int, str] = {}  # step -> hash of the bf16 export of the master right after it
    events: list[tuple[str, int]] = []  # ("stepped", step) / ("published", version), in order
    real_step, real_publish = recipe.train_step, Registry.publish

    def recording_step(model: Any, *args: Any, **kw: Any) -> Any:
        out = real_step(model, *args, **kw)
        after_step[len(after_step) + 1] = state_sha256(export_state(model))
        events.append(("stepped", len(after_step)))
        return out

    def slow_publish(self: Registry, state: Any, **kw: Any) -> Any:
        time.sleep(0.5)  # an upload that takes a while
        info = real_publish(self, state, **kw)
        events.append(("published", info.version))
        return info

    monkeypatch.setattr(recipe, "train_step", recording_step)
    monkeypatch.setattr(Registry, "publish", slow_publish)
    part = samples[:16]  # 4 steps, 4 versions
    runs = {}
    for background in (True, False):
        root = tmp_path / ("background" if background else "inline")
        settings = make_settings(root, f"sqlite:///{root / 'flywheel.db'}", tiny_model_dir,
                                 publish_in_background=background, sharded_versions=False)  # Publisher, both
        settings = settings.model_copy(update={"bus": settings.bus.model_copy(update={"partitions": 1})})  # same batches
        registry = registry_for(settings)
        send(settings, [s.to_bytes() for s in part])
        after_step.clear()
        events.clear()
        stop, errors = threading.Event(), []
        thread = threading.Thread(target=lambda: run_or_record(recipe.train, settings, stop, errors), daemon=True)
        thread.start()
        deadline = time.monotonic() + 90
        while len(trained_ids(registry)) < len(part) and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.1)
        stop.set()
        thread.join(30)
        assert not errors and not thread.is_alive(), errors

        versions = registry.versions()[1:]
        assert [(v.version, v.train_step) for v in versions] == [(1, 1), (2, 2), (3, 3), (4, 4)], background
        for v in versions:
            assert v.sha256 == after_step[v.train_step], (background, v.version)
        if background:  # step v + 1 trained while v was being written
            for v in (1, 2, 3):
                assert events.index(("stepped", v + 1)) < events.index(("published", v)), events
        else:
            assert events == [e for v in (1, 2, 3, 4) for e in (("stepped", v), ("published", v))], events
        assert "parity" in versions[0].metrics  # on v0's samples, on the first step from v0
        runs[background] = [(v.sha256, {k: x for k, x in v.metrics.items() if k not in ("staleness", "publish_token")})
                            for v in versions]
    assert runs[True] == runs[False]
