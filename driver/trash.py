"""Removing claim directories without holding up the plugin: the trash.

A claim directory is removed in two steps: under the plugin's lock it is renamed into DATA/trash
(one system call, whatever it holds: a claim prepared by an older layout had a tenant-writable
directory); after the lock one background thread removes the moved tree
(driver/hostfs.remove_tree: iterative, bounded descriptors), so a huge tree never holds up other
claims nor the kubelet's call. What a stop or crash leaves in the trash is removed after the next
start.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from pathlib import Path

from driver import hostfs

log = logging.getLogger(__name__)


class Trash:
    """The trash of one claims directory. move() is called with the owner's lock held; the names
    moved since the last take() are then handed to remove_later() after the lock."""

    def __init__(self, claims_dir: Path, trash_dir: Path) -> None:
        self.claims_dir = claims_dir
        self.trash_dir = trash_dir
        self._moved: list[str] = []  # moved under the lock, not yet queued for removal
        self._remover = _Remover(trash_dir)

    def move(self, path: Path) -> bool:
        """Move the claim directory `path` into the trash; True if something was there."""
        self.trash_dir.mkdir(mode=0o700, exist_ok=True)
        try:
            name = hostfs.move_aside(path, self.claims_dir, self.trash_dir)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            # claims/ is another file system than DATA (an admin's mount): removed in place
            return hostfs.remove(path, self.claims_dir)
        if name is None:
            return False
        self._moved.append(name)
        return True

    def take(self) -> list[str]:
        """The names moved since the last take() (call with the owner's lock held)."""
        names, self._moved = self._moved, []
        return names

    def listing(self) -> list[str]:
        """Everything in the trash now (this start's moves and what a crash left)."""
        try:
            return sorted(os.listdir(self.trash_dir))
        except FileNotFoundError:
            return []
        except OSError as e:
            log.error("cannot list %s: %s", self.trash_dir, e)
            return []

    def remove_later(self, names: list[str]) -> None:
        self._remover.put(names)

    def idle(self, timeout: float) -> bool:
        """Wait until every queued removal is done (tests; False on timeout)."""
        return self._remover.idle(timeout)


class _Remover:
    """One thread that removes the trash entries it is given, in order, outside every lock of
    the plugin (started at the first entry). An entry that cannot be removed is one log line and
    stays for the next start."""

    def __init__(self, trash: Path) -> None:
        self.trash = trash
        self._queue: queue.Queue[str] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def put(self, names: list[str]) -> None:
        if not names:
            return
        for name in names:
            self._queue.put(name)
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trash", daemon=True)
                self._thread.start()

    def idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _run(self) -> None:
        while True:
            name = self._queue.get()
            try:
                hostfs.remove(self.trash / name, self.trash)
            except Exception as e:
                log.error("cannot remove %s: %s; left for the next start", self.trash / name, e)
            finally:
                self._queue.task_done()
