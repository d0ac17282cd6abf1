"""Small disks: a tmpfs of a few MiB mounted where a process writes (needs root), that can be
filled to the last byte and kept full, then freed; the disk-full faults run on it.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

from testbed.procs import ServiceUnavailable


class SmallDisk:
    """A tmpfs of ``size_mb`` at ``path``: :meth:`fill` makes it full, :meth:`free` not."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path, self.size_mb = path, size_mb
        self.filler = path / ".filler"
        self.mounted = False

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "tmpfs", str(self.path)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise ServiceUnavailable(f"cannot mount a {self.size_mb} MB tmpfs at {self.path} (needs root): "
                                     f"{result.stderr.strip()}")
        self.mounted = True

    def fill(self) -> int:
        """Write a filler file until the disk refuses (ENOSPC), down to the last block; returns its bytes."""
        written = 0
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (1 << 20, 1 << 16, 4096, 512, 1):
                chunk = b"\0" * size
                while True:
                    try:
                        n = os.write(fd, chunk)
                    except OSError:
                        break
                    written += n
                    if n < size:
                        break
        finally:
            os.close(fd)
        return written

    def keep_full(self, seconds: float, stop: threading.Event) -> int:
        """Fill now and top up every 50 ms for ``seconds`` (a writer that fails deletes its partial
        file, which would free room otherwise); returns the filler's bytes."""
        written = self.fill()
        deadline = time.monotonic() + seconds
        while not stop.wait(min(0.05, max(0.0, deadline - time.monotonic()))) and time.monotonic() < deadline:
            written += self.fill()
        return written

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            self.mounted = False
