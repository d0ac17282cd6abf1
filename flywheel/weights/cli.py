"""``flywheel weights ...``: the delta codec on safetensors files, from the command line.

``weights diff OLD NEW -o DELTA [--device D]``, ``weights apply OLD DELTA -o OUT``, ``weights stats
OLD NEW [--json] [--device D]`` on files; on the configured registry (``model.line``), ``weights
squash FROM TO -o DELTA`` and ``weights gc [--keep-rollback N] [--dry-run]``. ``--device`` picks
where the encoder finds the changed elements (``cpu``, ``cuda[:N]`` or ``auto``: a GPU when there
is one); the delta is the same either way. Each sets ``args.weights_func(args, settings)
-> exit code``; torch is imported only when a command runs, so building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def add_weights_commands(subparsers: Any) -> None:
    weights = subparsers.add_parser("weights", help="lossless weight deltas between safetensors files")
    sub = weights.add_subparsers(dest="weights_command", required=True)

    diff = sub.add_parser("diff", help="write the delta that turns OLD into NEW")
    diff.add_argument("old", type=Path)
    diff.add_argument("new", type=Path)
    diff.add_argument("-o", "--output", type=Path, required=True, help="delta file to write")
    _add_device(diff)
    diff.set_defaults(weights_func=_diff)

    apply = sub.add_parser("apply", help="rebuild NEW from OLD and a delta (verified by hash)")
    apply.add_argument("old", type=Path)
    apply.add_argument("delta", type=Path)
    apply.add_argument("-o", "--output", type=Path, required=True, help="safetensors file to write")
    apply.add_argument("--buffered", action="store_true",
                       help="write through the page cache (default: around it, O_DIRECT where the filesystem "
                            "allows, which leaves the file on disk and not in memory)")
    apply.set_defaults(weights_func=_apply)

    stats = sub.add_parser("stats", help="delta size against a full copy, XOR+zstd and an entropy floor")
    stats.add_argument("old", type=Path)
    stats.add_argument("new", type=Path)
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_device(stats)
    stats.set_defaults(weights_func=_stats)

    squash = sub.add_parser("squash", help="one delta between two registry versions (model.line)")
    squash.add_argument("old", type=int, help="the version the delta applies to")
    squash.add_argument("new", type=int, help="the version it rebuilds")
    squash.add_argument("-o", "--output", type=Path, required=True, help="delta file to write")
    squash.set_defaults(weights_func=_squash)

    gc = sub.add_parser("gc", help="delete the weights no node, canary, candidate or rollback needs")
    gc.add_argument("--keep-rollback", type=int, default=2, help="formerly stable versions kept (default 2)")
    gc.add_argument("--node-ttl", type=float, default=600.0, help="a node silent this long keeps nothing (s)")
    gc.add_argument("--dry-run", action="store_true", help="only list what would go")
    gc.set_defaults(weights_func=_gc)


def _add_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", metavar="cpu|cuda|auto",
                        help="where to find the changed elements: cpu (default), cuda[:N], or auto "
                             "(cuda when available); the delta is the same")


def _read_state(path: Path) -> dict[str, Any]:
    """The state in a safetensors file, in name order (as ``diff`` codes it), held whole (``stats``)."""
    from flywheel.weights.codec.tensorfile import TensorReader

    with TensorReader(path) as reader:
        return {name: reader.read(name).clone() for name in sorted(reader.index)}


@contextlib.contextmanager
def _atomic_output(path: Path) -> Iterator[int]:
    """A file descriptor to write ``path`` through: the file appears whole (fsynced, then renamed
    into place) when the block ends, or not at all when it raises. The temp file beside it has a
    random name and is created exclusively (``mkstemp``): a predictable name could be a symlink
    someone planted in a shared folder, and writing through it would overwrite whatever it points at."""
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0o022)  # the mode a plain open() would give (mkstemp's is 0600); a CLI has one thread
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        yield fd
        os.fsync(fd)  # the data on disk before the name points at it: a crash leaves the old file or the new
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (:func:`_atomic_output`)."""
    import os

    with _atomic_output(path) as fd:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]


def _fail(message: str) -> int:
    print(f"flywheel weights: {message}", file=sys.stderr)
    return 1


def _diff(args: argparse.Namespace, _settings: Any = None) -> int:
    from flywheel.weights.codec.delta import resolve_device
    from flywheel.weights.codec.streaming import diff_files

    start = time.perf_counter()
    try:
        device = resolve_device(args.device)
        delta, summary = diff_files(args.old, args.new, device=device)
    except (ValueError, OSError) as exc:  # an unusable --device, an unreadable file (DeltaError is a ValueError)
        return _fail(str(exc))
    _write_atomic(args.output, delta)
    elapsed = time.perf_counter() - start
    full = summary["bytes_full"]
    share = 100 * len(delta) / max(full, 1)
    where = f" on {device}" if device is not None else ""
    print(f"wrote {args.output}: {len(delta):,} bytes ({share:.2f}% of {full:,}) in {elapsed:.2f}s{where}")
    return 0


def _apply(args: argparse.Namespace, _settings: Any = None) -> int:
    from flywheel.weights.codec.state import DeltaError
    from flywheel.weights.codec.streaming import apply_files

    start = time.perf_counter()
    try:
        delta = args.delta.read_bytes()
        with _atomic_output(args.output) as fd:
            sha = apply_files(args.old, delta, fd, direct=not args.buffered)
    except (OSError, DeltaError) as exc:
        return _fail(str(exc))
    print(f"wrote {args.output}: sha256 {sha} (verified) in {time.perf_counter() - start:.2f}s")
    return 0


def _stats(args: argparse.Namespace, _settings: Any = None) -> int:
    from flywheel.weights.codec.delta import resolve_device
    from flywheel.weights.codec.stats import delta_stats

    try:
        device = resolve_device(args.device)
        old, new = _read_state(args.old), _read_state(args.new)
    except (ValueError, OSError) as exc:  # an unusable --device, an unreadable file (DeltaError is a ValueError)
        return _fail(str(exc))
    stats = delta_stats(old, new, device=device)
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(format_stats(stats))
    return 0


def _registry(settings: Any) -> Any:
    from flywheel.db.session import make_session_factory, open_database
    from flywheel.weights.registry import Registry
    from flywheel.weights.store import make_store

    engine = open_database(settings.database_url, settings.db.wait_s)
    return Registry(make_session_factory(engine), make_store(settings), settings.model.line)


def _squash(args: argparse.Namespace, settings: Any) -> int:
    from flywheel.weights.registry import WeightsError

    try:
        delta = _registry(settings).squash(args.old, args.new)
    except WeightsError as exc:
        return _fail(str(exc))
    _write_atomic(args.output, delta)
    print(f"wrote {args.output}: {len(delta):,} bytes, v{args.old} -> v{args.new} (verified)")
    return 0


def _gc(args: argparse.Namespace, settings: Any) -> int:
    from flywheel.weights.collect import collect
    from flywheel.weights.store import StoreError

    registry = _registry(settings)
    try:
        gone = collect(registry, keep_rollback=args.keep_rollback, node_ttl_s=args.node_ttl, dry_run=args.dry_run)
    except StoreError as exc:  # e.g. a registry row whose store_key is not a safe key: nothing outside is touched
        return _fail(f"gc stopped: {exc}")
    verb = "would collect" if args.dry_run else "collected"
    print(f"{verb} {len(gone)} version(s) of {registry.model_line}: {', '.join(f'v{v}' for v in gone) or '-'}")
    return 0


def format_stats(stats: dict[str, Any]) -> str:
    """A plain-text table of :func:`flywheel.weights.codec.stats.delta_stats`' result."""
    head = (
        f"{'dtype':<10} {'tensors':>7} {'elements':>12} {'changed':>8} {'full':>12} "
        f"{'delta':>12} {'xor+zstd':>12} {'floor':>12}"
    )
    lines = [head, "-" * len(head)]

    def row(label: str, r: dict[str, Any], delta: int) -> str:
        full = max(r["bytes_full"], 1)
        pct = lambda n: f"{n:,} {100 * n / full:5.1f}%"  # noqa: E731
        return (
            f"{label:<10} {r.get('tensors', 0):>7} {r['elements']:>12,} {100 * r['fraction_changed']:>7.2f}% "
            f"{r['bytes_full']:>12,} {pct(delta):>12} {pct(r['bytes_xor_zstd']):>12} "
            f"{pct(r['bytes_entropy_floor']):>12}"
        )

    for dtype, r in sorted(stats["by_dtype"].items()):
        lines.append(row(dtype, r, r["bytes_delta"]))
    lines.append("-" * len(head))
    lines.append(row("total", stats, stats["bytes_delta"]))
    schemes = ", ".join(f"{k} {v}" for k, v in stats["schemes"].items())
    lines.append(f"tensors by scheme: {schemes} (total delta includes its header)")
    return "\n".join(lines)
