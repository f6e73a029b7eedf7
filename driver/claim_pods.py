"""The `pod` label of a slice: the pods a claim is reserved for (status.reservedFor), read from
the API server in the background so that a scrape never waits on it.

A lookup answers from its cache at once ("" until the first read returns) and starts a refresh
when the entry is older than REFRESH seconds; at most one read runs per claim at a time. Several
pods (a shared claim) are joined with commas, sorted.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from driver.claims import ClaimError, ClaimRef, read_claim

log = logging.getLogger(__name__)

REFRESH = 30.0  # seconds an answer is used before it is read again
TIMEOUT = 5.0  # seconds per API read


def reserved_pods(claim: dict[str, Any]) -> str:
    refs = (claim.get("status") or {}).get("reservedFor") or []
    return ",".join(
        sorted(
            str(r.get("name", "")) for r in refs if r.get("resource") == "pods" and r.get("name")
        )
    )


class ClaimPods:
    def __init__(self, api_client: Any, refresh: float = REFRESH) -> None:
        self.api_client = api_client
        self.refresh = refresh
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, str]] = {}  # uid -> (monotonic time read, pods)
        self._busy: set[str] = set()

    def __call__(self, namespace: str, name: str, uid: str) -> str:
        now = time.monotonic()
        with self._lock:
            read_at, pods = self._cache.get(uid, (-1e18, ""))
            if now - read_at > self.refresh and uid not in self._busy:
                self._busy.add(uid)
                ref = ClaimRef(namespace=namespace, name=name, uid=uid)
                threading.Thread(target=self._read, args=(ref,), daemon=True).start()
        return pods

    def _read(self, ref: ClaimRef) -> None:
        try:
            claim = read_claim(self.api_client, ref, timeout=TIMEOUT)
            pods = reserved_pods(claim) if claim.get("metadata", {}).get("uid") == ref.uid else ""
            with self._lock:
                self._cache[ref.uid] = (time.monotonic(), pods)
        except ClaimError as e:
            log.debug("pod label of claim %s/%s: %s", ref.namespace, ref.name, e)
            with self._lock:  # keep the last answer; try again after `refresh`, not at once
                self._cache[ref.uid] = (time.monotonic(), self._cache.get(ref.uid, (0.0, ""))[1])
        finally:
            with self._lock:
                self._busy.discard(ref.uid)
