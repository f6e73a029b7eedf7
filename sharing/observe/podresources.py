"""Which pods and containers hold each claim: the kubelet's PodResources API (gRPC on
/var/lib/kubelet/pod-resources/kubelet.sock, `v1.PodResourcesLister/List`; stubs in
sharing/observe/proto/). For every container of every pod on the node it lists the DRA claims the
kubelet gave it, with the CDI devices each claim's driver prepared. The plugin names a claim's
own CDI device after the claim's UID, so those names map a slice to the namespace, pod and
container names that dcgm-exporter's and HAMi's dashboards label series with.

Read in a background thread so that a scrape never waits on the kubelet: a lookup answers from
the last List at once (nothing until the first one returns) and starts a new List when that one
is older than `refresh` seconds. Without the socket, or when the kubelet does not answer, the
answer stays what it was (empty when the API never answered) and the trouble is logged once,
until the API answers again.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from sharing.observe.proto import podresources_v1_pb2 as pb
from sharing.observe.proto import podresources_v1_pb2_grpc as pb_grpc
from sharing.observe.slices import PodContainer

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
REFRESH = 10.0  # seconds an answer is used before the kubelet is asked again
TIMEOUT = 5.0  # seconds per List


def holders_by_cdi_device(resp: Any) -> dict[str, tuple[PodContainer, ...]]:
    """CDI device name -> the containers it was given to, sorted, from a ListPodResourcesResponse."""
    found: dict[str, set[PodContainer]] = {}
    for pod in resp.pod_resources:
        for c in pod.containers:
            holder = PodContainer(pod.namespace, pod.name, c.name)
            for dr in c.dynamic_resources:
                for cr in dr.claim_resources:
                    for dev in cr.cdi_devices:
                        if dev.name:
                            found.setdefault(dev.name, set()).add(holder)
    return {name: tuple(sorted(hs)) for name, hs in found.items()}


class PodResources:
    """The kubelet's answer, refreshed in the background. Call it with a claim's own CDI device
    names to get the containers holding them."""

    def __init__(
        self, socket: str = DEFAULT_SOCKET, refresh: float = REFRESH, timeout: float = TIMEOUT
    ) -> None:
        self.socket = socket
        self.refresh = refresh
        self.timeout = timeout
        self._lock = threading.Lock()
        self._reading = threading.Lock()
        self._by_cdi: Mapping[str, tuple[PodContainer, ...]] = {}
        self._read_at = -1e18  # monotonic time of the last attempt
        self._busy = False
        self._trouble = ""  # what was logged last ("" = the API answered)
        self._channel: grpc.Channel | None = None
        self._closed = False

    def __call__(self, cdi_devices: Sequence[str]) -> tuple[PodContainer, ...]:
        self.poke()
        with self._lock:
            by_cdi = self._by_cdi
        found = {h for name in cdi_devices for h in by_cdi.get(name, ())}
        return tuple(sorted(found))

    def poke(self) -> None:
        """Start a List in the background if the last answer is old and none is running."""
        now = time.monotonic()
        with self._lock:
            if self._busy or now - self._read_at <= self.refresh:
                return
            self._busy = True
            self._read_at = now
        threading.Thread(target=self._read, name="pod-resources", daemon=True).start()

    def read(self) -> bool:
        """One List now, in this thread; True when the kubelet answered."""
        with self._lock:
            self._busy = True
            self._read_at = time.monotonic()
        return self._read()

    def _read(self) -> bool:
        try:
            with self._reading:  # one List at a time: read() may come while one runs
                by_cdi = self._list()
        except _Unavailable as e:
            self._note(str(e))
            return False
        finally:
            with self._lock:
                self._busy = False
        with self._lock:
            self._by_cdi = by_cdi
        self._note("")
        return True

    def _list(self) -> dict[str, tuple[PodContainer, ...]]:
        try:
            st = os.stat(self.socket)
        except OSError as e:
            raise _Unavailable(f"{self.socket}: {e.strerror}") from None
        if not stat.S_ISSOCK(st.st_mode):
            raise _Unavailable(f"{self.socket}: not a socket")
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"unix://{self.socket}")
        stub = pb_grpc.PodResourcesListerStub(self._channel)
        try:
            resp = stub.List(pb.ListPodResourcesRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            details = e.details() if isinstance(e, grpc.Call) else str(e)
            name = code.name if code is not None else "error"
            raise _Unavailable(f"{self.socket}: List: {name}: {details}") from None
        return holders_by_cdi_device(resp)

    def _note(self, trouble: str) -> None:
        """One log line per change: the API lost (and why), or back."""
        with self._lock:
            if self._closed or trouble == self._trouble or (trouble and self._trouble):
                return  # closed: a List cut short by close() is no trouble to report
            before, self._trouble = self._trouble, trouble
        if trouble:
            log.warning(
                "kubelet PodResources API unavailable (%s): the pod and container labels of "
                "slices stay as they are (empty until it answers)",
                trouble,
            )
        elif before:
            log.info("kubelet PodResources API at %s answers again", self.socket)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            ch, self._channel = self._channel, None
        if ch is not None:
            ch.close()


class _Unavailable(Exception):
    """The API did not answer; str() is one line."""
