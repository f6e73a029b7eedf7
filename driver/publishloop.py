"""The publishing thread: the latest Inventory goes to the API server, retried with backoff while
the API fails, and the pool re-checked every `resync` seconds."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from driver.backoff import Backoff
from driver.devicenames import Mode
from driver.discovery import Inventory
from driver.kube import ApiException
from driver.slicepublisher import SlicePublisher

log = logging.getLogger(__name__)


def describe_error(e: BaseException) -> str:
    """One short line: 'HTTP 503 Service Unavailable', 'NewConnectionError: ... refused'."""
    if isinstance(e, ApiException):
        return f"HTTP {e.status} {e.reason or ''}".strip()
    # urllib3's MaxRetryError wraps the real cause in .reason.
    reason = getattr(e, "reason", None)
    if isinstance(reason, BaseException):
        e = reason
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"[:200]


@dataclass
class PublishLoop:
    """Publishes the latest Inventory from a thread, retrying with backoff while the API fails.

    Also re-checks the pool every `resync` seconds, so a slice someone deleted or changed is
    written again.
    """

    publisher: SlicePublisher
    backoff: Backoff = field(default_factory=Backoff)
    resync: float = 30.0
    on_mode: Callable[[Mode], None] | None = None
    _desired: Inventory | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _stopping: bool = False
    _published: Inventory | None = None
    _healthy_api: bool = True
    _thread: threading.Thread | None = None

    def submit(self, inv: Inventory) -> None:
        with self._cond:
            self._desired = inv
            self._cond.notify_all()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="slice-publisher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def api_reachable(self) -> bool:
        return self._healthy_api

    @property
    def published_once(self) -> bool:
        """True once any Inventory has been published (readiness)."""
        with self._cond:
            return self._published is not None

    def republish(self) -> None:
        """Write the latest Inventory again now (the policy changed what it publishes as)."""
        self.publisher.forget_warnings()
        with self._cond:
            if self._desired is not None:
                self._desired = Inventory(gpus=self._desired.gpus)
            self._cond.notify_all()

    def wait_published(self, timeout: float) -> bool:
        """Until the latest submitted Inventory is on the server (or timeout)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._desired is None or self._published is not self._desired:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def run(self) -> None:
        delays = iter(self.backoff.delays())
        next_resync = time.monotonic() + self.resync
        while True:
            with self._cond:
                while not self._stopping and (
                    self._desired is None
                    or (self._published is self._desired and time.monotonic() < next_resync)
                ):
                    self._cond.wait(
                        max(0.0, next_resync - time.monotonic()) if self._desired else None
                    )
                if self._stopping:
                    return
                inv = self._desired
            assert inv is not None
            try:
                self.publisher.publish(inv)
            except Exception as e:
                delay = next(delays)
                self._healthy_api = False
                log.warning(
                    "node %s: publishing ResourceSlices failed (%s); retrying in %gs",
                    self.publisher.node_name,
                    describe_error(e),
                    delay,
                )
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping, timeout=delay)
                continue
            if not self._healthy_api:
                log.info(
                    "node %s: API server reachable again; ResourceSlices published",
                    self.publisher.node_name,
                )
            self._healthy_api = True
            delays = iter(self.backoff.delays())
            next_resync = time.monotonic() + self.resync
            mode = self.publisher.server_mode or self.publisher.mode
            if mode is not None and self.on_mode is not None:
                self.on_mode(mode)
            with self._cond:
                self._published = inv
                self._cond.notify_all()
