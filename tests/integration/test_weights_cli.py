"""``flywheel weights``: diff / apply / stats on safetensors files, squash / gc on the registry."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import safetensors.torch
import torch

from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.weights.codec.state import state_sha256
from flywheel.weights.registry import Registry
from flywheel.weights.store import FolderStore
from launch.cli import main
from tests.integration.test_registry import assert_bit_exact, make_state, train_step

pytestmark = pytest.mark.integration


def write_file(path: Path, state: dict[str, torch.Tensor]) -> None:
    """``state`` as a plain safetensors file, the files the command works on."""
    path.write_bytes(safetensors.torch.save({k: v.contiguous() for k, v in state.items()}))


def read_file(path: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load(path.read_bytes())


def test_diff_apply_and_stats_on_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(1)
    old = make_state(rng)
    new = train_step(rng, old)
    write_file(tmp_path / "old.safetensors", old)
    write_file(tmp_path / "new.safetensors", new)
    assert main(["weights", "diff", str(tmp_path / "old.safetensors"), str(tmp_path / "new.safetensors"),
                 "-o", str(tmp_path / "d.delta")]) == 0
    assert main(["weights", "apply", str(tmp_path / "old.safetensors"), str(tmp_path / "d.delta"),
                 "-o", str(tmp_path / "out.safetensors")]) == 0
    assert_bit_exact(read_file(tmp_path / "out.safetensors"), new)
    assert main(["weights", "apply", "--buffered", str(tmp_path / "old.safetensors"), str(tmp_path / "d.delta"),
                 "-o", str(tmp_path / "buffered.safetensors")]) == 0
    assert (tmp_path / "buffered.safetensors").read_bytes() == (tmp_path / "out.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["weights", "stats", str(tmp_path / "old.safetensors"), str(tmp_path / "new.safetensors"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert 0.01 < stats["fraction_changed"] < 0.05 and stats["bytes_delta"] < stats["bytes_full"]
    # A delta applied to the wrong base is refused, nothing written.
    assert main(["weights", "apply", str(tmp_path / "new.safetensors"), str(tmp_path / "d.delta"),
                 "-o", str(tmp_path / "wrong.safetensors")]) == 1
    assert not (tmp_path / "wrong.safetensors").exists()


def test_diff_and_apply_sync_their_output_before_it_takes_the_name(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash right after the rename must not leave a short file under the output's name: the
    temp file is fsynced before it is renamed into place."""
    rng = random.Random(2)
    old = make_state(rng)
    write_file(tmp_path / "old.safetensors", old)
    write_file(tmp_path / "new.safetensors", train_step(rng, old))
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def synced(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def renamed(src: str, dst: str) -> None:
        events.append(("replace", str(src)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(os, "replace", renamed)
    assert main(["weights", "diff", str(tmp_path / "old.safetensors"), str(tmp_path / "new.safetensors"),
                 "-o", str(tmp_path / "d.delta")]) == 0
    assert main(["weights", "apply", str(tmp_path / "old.safetensors"), str(tmp_path / "d.delta"),
                 "-o", str(tmp_path / "out.safetensors")]) == 0
    renames = [src for kind, src in events if kind == "replace"]
    assert len(renames) == 2
    for src in renames:
        assert events.index(("fsync", src)) < events.index(("replace", src)), events


def test_diff_and_stats_on_a_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--device``: the same delta wherever the changes are found; a GPU that is not there is one
    line of error and exit code 1, before any file is read or written."""
    rng = random.Random(3)
    old = make_state(rng)
    new = train_step(rng, old)
    paths = [str(tmp_path / "old.safetensors"), str(tmp_path / "new.safetensors")]
    write_file(tmp_path / "old.safetensors", old)
    write_file(tmp_path / "new.safetensors", new)
    assert main(["weights", "diff", *paths, "-o", str(tmp_path / "cpu.delta")]) == 0
    assert main(["weights", "diff", *paths, "-o", str(tmp_path / "auto.delta"), "--device", "auto"]) == 0
    assert (tmp_path / "auto.delta").read_bytes() == (tmp_path / "cpu.delta").read_bytes()
    capsys.readouterr()
    assert main(["weights", "stats", *paths, "--json", "--device", "auto"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_delta"] == len((tmp_path / "cpu.delta").read_bytes())
    for command in (["diff", *paths, "-o", str(tmp_path / "gpu.delta")], ["stats", *paths]):
        for device in ("cuda", "tpu"):
            if device == "cuda" and torch.cuda.is_available():
                assert main(["weights", *command, "--device", "cuda"]) == 0
                continue
            assert main(["weights", *command, "--device", device]) == 1
            out, err = capsys.readouterr()
            assert out == "" and err.count("\n") == 1 and err.startswith("flywheel weights: ")
            assert ("CUDA is not available" if device == "cuda" else "unknown device") in err
    if torch.cuda.is_available():
        assert (tmp_path / "gpu.delta").read_bytes() == (tmp_path / "cpu.delta").read_bytes()
    else:
        assert not (tmp_path / "gpu.delta").exists()


def test_squash_and_gc_on_the_configured_registry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db_url = f"sqlite:///{tmp_path / 'fw.db'}"
    upgrade(db_url)
    config = tmp_path / "fw.json"
    config.write_text(json.dumps({"db": {"url": db_url}, "store": {"path": str(tmp_path / "weights")},
                                  "model": {"line": "cli-line"}}))
    engine = make_engine(db_url)
    registry = Registry(make_session_factory(engine), FolderStore(tmp_path / "weights"), "cli-line")
    rng = random.Random(2)
    states = [make_state(rng)]
    registry.publish(states[0], parent=None)
    for v in range(1, 4):
        states.append(train_step(rng, states[-1]))
        registry.publish(states[v], parent=v - 1, parent_state=states[v - 1])
    registry.set_status(3, "stable", "test")
    engine.dispose()

    assert main(["--config", str(config), "weights", "squash", "0", "3", "-o", str(tmp_path / "s.delta")]) == 0
    write_file(tmp_path / "v0.safetensors", states[0])
    assert main(["weights", "apply", str(tmp_path / "v0.safetensors"), str(tmp_path / "s.delta"),
                 "-o", str(tmp_path / "v3.safetensors")]) == 0
    assert state_sha256(read_file(tmp_path / "v3.safetensors")) == state_sha256(states[3])
    capsys.readouterr()
    # Every version is on stable v3's chain: nothing to collect.
    assert main(["--config", str(config), "weights", "gc", "--dry-run"]) == 0
    assert "would collect 0 version(s)" in capsys.readouterr().out
