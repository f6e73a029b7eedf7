"""The Kubernetes API as the driver uses it: a configured ApiClient and a few JSON-level calls.

Objects travel as plain JSON dicts (`_preload_content=False`): the driver compares what it
sent with what the server stored field by field, and a dict keeps fields the generated models
do not know. Every call has a timeout, so a hung API server cannot stall the publisher.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.config
from kubernetes.client import ApiClient, CoreV1Api, ResourceV1Api, V1ResourceSlice
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 10.0  # seconds, per call

__all__ = ["REQUEST_TIMEOUT", "ApiException", "Kube", "KubeConfigError", "make_api_client"]


class KubeConfigError(RuntimeError):
    """No usable Kubernetes client configuration. str() is one line."""


def make_api_client(kubeconfig: Path | None) -> ApiClient:
    """From the kubeconfig file, or the in-cluster service account when None."""
    cfg = kubernetes.client.Configuration()
    try:
        if kubeconfig is not None:
            kubernetes.config.load_kube_config(  # type: ignore[no-untyped-call]
                str(kubeconfig), client_configuration=cfg
            )
        else:
            kubernetes.config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=cfg
            )
    except (kubernetes.config.ConfigException, OSError) as e:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster configuration"
        hint = "" if kubeconfig else " (outside a cluster pass --kubeconfig or KUBECONFIG)"
        raise KubeConfigError(f"cannot load {where}: {e}{hint}") from e
    # The publisher has its own backoff; urllib3's silent retries would only hide outages.
    cfg.retries = 0
    return ApiClient(cfg)


def _model(body: dict[str, Any]) -> V1ResourceSlice:
    model = V1ResourceSlice.from_dict(body)
    if model is None:  # from_dict answers None only for None
        raise ValueError("empty ResourceSlice body")
    return model


def _json(resp: Any) -> dict[str, Any]:
    data = json.loads(resp.data)
    if not isinstance(data, dict):
        raise ValueError(f"the API server answered with JSON {type(data).__name__}, not an object")
    return data


class Kube:
    """ResourceSlices and Nodes as JSON dicts."""

    def __init__(self, api_client: ApiClient, timeout: float = REQUEST_TIMEOUT) -> None:
        self.api_client = api_client
        self.resource = ResourceV1Api(api_client)
        self.core = CoreV1Api(api_client)
        self.timeout = timeout

    def read_node(self, name: str) -> dict[str, Any]:
        return _json(
            self.core.read_node(name, _preload_content=False, _request_timeout=self.timeout)
        )

    def list_slices(self, field_selector: str) -> list[dict[str, Any]]:
        resp = self.resource.list_resource_slice(
            field_selector=field_selector, _preload_content=False, _request_timeout=self.timeout
        )
        items = _json(resp).get("items") or []
        return [i for i in items if isinstance(i, dict)]

    def create_slice(self, body: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        return _json(
            self.resource.create_resource_slice(
                _model(body),
                dry_run="All" if dry_run else None,
                _preload_content=False,
                _request_timeout=self.timeout,
            )
        )

    def replace_slice(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return _json(
            self.resource.replace_resource_slice(
                name,
                _model(body),
                _preload_content=False,
                _request_timeout=self.timeout,
            )
        )

    def delete_slice(self, name: str) -> bool:
        """False if it was already gone."""
        try:
            self.resource.delete_resource_slice(
                name, _preload_content=False, _request_timeout=self.timeout
            )
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return True
