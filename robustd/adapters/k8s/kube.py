"""The Kubernetes API as robustd-k8s uses it, through the official client: nodes, their status, events.

Objects travel as plain JSON dicts (read with `_preload_content=False`, written as dicts), not as the
client's model classes: a read-modify-write of a Node must not drop fields this client version does
not know. Every request has `k8s.request_timeout`; the client's own urllib3 retries are off, because
the reconciler retries everything itself with backoff and jitter. Failures are sorted into what a
retry may fix (Transient: timeouts, connection errors, 429, 5xx), a lost race (Conflict, 409), an
object that is already there (AlreadyExists) or gone (NotFound), and a refusal no retry fixes soon
(Refused: 401, 403, 400, 422 — wrong credentials, RBAC, a bug), which is logged as an ERROR with
the server's own message.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import pydantic
import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

MAX_RESPONSE = 64 << 20  # a Node can be large (its image list); a page of node metadata is far smaller
SMP = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
LIST_PAGE = 500
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"  # a list of metadata only
# Every write names this field manager, so the Node's managedFields tell robustd-k8s's fields from another
# actor's (a `kubectl cordon` is `kubectl-cordon`): the release uncordons only a cordon still robustd-k8s's.
FIELD_MANAGER = "robustd-k8s"
MAX_PAGES = 100  # 50,000 nodes


class KubeError(Exception):
    def __init__(self, text: str, status: int = 0, retry_after: float | None = None):
        super().__init__(text)
        self.status = status
        self.retry_after = retry_after


class Transient(KubeError):
    """Worth retrying after a backoff: a timeout, a refused connection, 429, 5xx."""


class Refused(KubeError):
    """The API server refused the request itself (401, 403, 400, 422, ...): credentials, RBAC or a bug."""


class Conflict(KubeError):
    """409: the object changed since it was read (a stale resourceVersion)."""


class AlreadyExists(KubeError):
    """409 AlreadyExists on a create."""


class NotFound(KubeError):
    """404."""


def api_client(kubeconfig: str | None) -> client.ApiClient:
    """A client from a kubeconfig file, else from the pod's service account (in-cluster).

    Raises kubernetes.config.ConfigException when neither is usable (a clear message of its own)."""
    conf = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=conf, persist_config=False)
    else:
        config.load_incluster_config(client_configuration=conf)
    conf.retries = 0  # no urllib3 retries below ours
    return client.ApiClient(conf)


def _message(e: ApiException) -> str:
    try:
        body = json.loads(e.body or "{}")
        if isinstance(body, dict) and body.get("message"):
            return str(body["message"])[:512]
    except (TypeError, ValueError):
        pass
    return str(e.reason or "")[:512]


def _classify(e: ApiException, what: str) -> KubeError:
    status = int(e.status or 0)
    text = f"{what}: {status} {e.reason}: {_message(e)}"
    if status == 409:
        body = e.body or ""
        return AlreadyExists(text, status) if "AlreadyExists" in body else Conflict(text, status)
    if status == 404:
        return NotFound(text, status)
    if status == 429 or status >= 500 or status == 0:
        retry_after = None
        try:
            header = (e.headers or {}).get("Retry-After")
            retry_after = float(header) if header is not None else None
        except (TypeError, ValueError):
            pass
        return Transient(text, status, retry_after)
    return Refused(text, status)


def field_owners(obj: dict[str, Any], *path: str) -> list[str]:
    """The field managers whose metadata.managedFields hold the field at `path` (e.g. "spec", "unschedulable"),
    in the server's order; [] when none does (or the server keeps no managed fields)."""
    owners = []
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        tree = entry.get("fieldsV1") if isinstance(entry, dict) else None
        for part in path:
            tree = tree.get(f"f:{part}") if isinstance(tree, dict) else None
        if tree is not None and entry.get("manager"):
            owners.append(str(entry["manager"])[:128])
    return owners


class Kube:
    """The calls robustd-k8s makes; each returns the server's answer as a dict or raises a KubeError."""

    def __init__(self, api: client.ApiClient, timeout: float):
        self.api = api
        self.core = client.CoreV1Api(api)
        self.timeout = timeout

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            resp = fn(*args, _preload_content=False, _request_timeout=self.timeout, **kwargs)
            try:
                raw = resp.read(MAX_RESPONSE + 1)
            finally:
                resp.release_conn()
        except ApiException as e:
            raise _classify(e, what) from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise Transient(f"{what}: {type(e).__name__}: {e}") from None
        except pydantic.ValidationError as e:  # the client checks a body against its model before sending
            raise Refused(f"{what}: the client refused the body: {e.error_count()} errors, first: "
                          f"{e.errors()[0].get('loc')}: {e.errors()[0].get('msg')}") from None
        if len(raw) > MAX_RESPONSE:
            raise Refused(f"{what}: the answer is larger than {MAX_RESPONSE} bytes")
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise Transient(f"{what}: the answer is not JSON ({e})") from None
        if not isinstance(data, dict):
            raise Transient(f"{what}: the answer is not a JSON object")
        return data

    def get_node(self, name: str) -> dict[str, Any]:
        return self._call(f"get node {name}", self.core.read_node, name)

    def patch_node_status(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A strategic merge patch of the status subresource (conditions merge by `type`)."""
        return self._call(f"patch node {name} status", self.core.patch_node_status, name, patch, _content_type=SMP,
                          field_manager=FIELD_MANAGER)

    def patch_node_if_unchanged(self, name: str, patch: dict[str, Any], resource_version: str) -> dict[str, Any]:
        """A JSON merge patch that carries the resourceVersion read: Conflict if someone wrote the node since.

        This is the read-modify-write the issue asks for (taints are a list without a merge key, so the
        whole list is written) without a PUT of the whole Node: this client checks a PUT body against its
        own model and refuses fields it does not know, which a newer API server may well return."""
        body = {**patch, "metadata": {**(patch.get("metadata") or {}), "resourceVersion": resource_version}}
        return self._call(f"update node {name}", self.core.patch_node, name, body, _content_type=MERGE,
                          field_manager=FIELD_MANAGER)

    def list_node_metadata(self, selector: str) -> list[dict[str, Any]]:
        """The metadata of every node matching `selector` (labels, annotations; no spec, no status, no image
        list), as kubectl asks for it: a PartialObjectMetadataList, paged. A server that answers a whole
        NodeList instead (the Accept header's fallback) gives the same metadata."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        for _ in range(MAX_PAGES):
            kwargs: dict[str, Any] = {"limit": LIST_PAGE, "_headers": {"Accept": f"{METADATA_LIST},application/json"}}
            if selector:
                kwargs["label_selector"] = selector
            if token:
                kwargs["_continue"] = token
            page = self._call("list nodes", self.core.list_node, **kwargs)
            items.extend(i["metadata"] for i in page.get("items") or []
                         if isinstance(i, dict) and isinstance(i.get("metadata"), dict))
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items
        raise Refused(f"list nodes: more than {LIST_PAGE * MAX_PAGES} nodes match {selector!r}")

    def create_event(self, namespace: str, event: dict[str, Any]) -> dict[str, Any]:
        return self._call(f"create event in {namespace}", self.core.create_namespaced_event, namespace, event,
                          field_manager=FIELD_MANAGER,
                          _headers={"Content-Type": "application/json"})  # this client version sets none for a POST

    def patch_event(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self._call(f"patch event {namespace}/{name}", self.core.patch_namespaced_event, name, namespace,
                          patch, _content_type=SMP, field_manager=FIELD_MANAGER)
