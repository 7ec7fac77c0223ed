"""A stand-in for kube-apiserver: a real HTTP server, in a thread, keeping Kubernetes' semantics for the
endpoints robustd-k8s uses (no kube-apiserver can be installed here: no Debian or PyPI package ships one).

What it keeps, as the real server does:
- Nodes: GET one, LIST (labelSelector: `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`),
  PATCH and PUT of `nodes/{name}` and of the `status` subresource. A write to the main resource leaves
  `.status` alone and a write to `/status` changes only `.status`. Three patch types by Content-Type:
  strategic merge (lists with a merge key — `status.conditions` and `status.addresses` by `type` — merged
  item by item, `$patch: delete|replace` honoured; lists without one, such as `spec.taints`, replaced),
  JSON merge patch (RFC 7386) and JSON patch (RFC 6902, the `jsonpatch` library). PUT, and a patch that
  carries `metadata.resourceVersion`, must name the current resourceVersion: a stale one is 409 Conflict.
  Every change bumps the resourceVersion. Malformed conditions or taints are 422, as validation makes them.
- Events: create (409 AlreadyExists for a taken name), patch, list, in namespaces.
- A node list in metadata only, as kubectl asks for it (`Accept: application/json;as=PartialObjectMetadataList;
  g=meta.k8s.io;v=v1`, with fallbacks after a comma): kind PartialObjectMetadataList, apiVersion meta.k8s.io/v1,
  items of kind PartialObjectMetadata holding only `metadata`; 406 for an Accept it cannot serve.
- 404 for an unknown node or event, 401 for an unknown token, 403 for a token without the verb on the
  resource (RBAC is modelled as a set of (verb, resource) pairs per token), 415 for an unknown patch type,
  413 for a body over 1 MiB. Errors are `Status` objects like the real ones.
- Injected failures: a status (429 with Retry-After, 500, 503, ...) or a timeout (the request is held,
  then the connection closed without an answer) for the next N matching requests or for a while.
- A concurrent writer: a function applied to a node just before the next write of it, as another
  controller's write between our GET and our write would be (so a write naming the old resourceVersion
  meets a 409).
- A request log: method, path, query, content type, parsed body, answer status, RBAC verb and resource.
- metadata.managedFields on nodes and events: one entry per manager (the `fieldManager` query parameter of a
  POST, PUT or PATCH, else the User-Agent up to its first `/`, as the server derives it; 422 past 128
  characters), operation Update, `subresource: status` for a write of `/status`, fieldsType FieldsV1. A
  write takes the fields whose value it changed (not those it wrote unchanged) from every other manager; a
  field it removed belongs to no one; a manager left with no field is dropped. Lists with a merge key
  (`status.conditions` by `type`) are owned item by item (`k:{"type":"X"}`, with `.` for the item), other
  lists (`spec.taints`) whole. A `managedFields` in a request body is ignored.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import jsonpatch
import yaml

MAX_BODY = 1 << 20
ALL = "*"
SMP = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSONPATCH = "application/json-patch+json"
# Lists the strategic merge patch merges item by item, by this key (from the Node type's patchMergeKey tags).
MERGE_KEYS = {("status", "conditions"): "type", ("status", "addresses"): "type",
              ("metadata", "ownerReferences"): "uid"}
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


class HTTPError(Exception):
    def __init__(self, code: int, reason: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.headers = code, reason, message, headers or {}


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any
    token: str
    verb: str = ""
    resource: str = ""
    status: int = 0
    field_manager: str = ""
    accept: str = ""


@dataclass
class Fault:
    what: int | str  # an HTTP status, or "timeout"
    count: int | None  # how many more requests it takes; None: until `until`
    until: float | None
    match: Callable[[str, str], bool]
    hold: float = 0.0  # a timeout: how long the request is held before the connection is closed
    retry_after: int | None = None


@dataclass
class State:
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    rv: int = 100


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def strategic_merge(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """Kubernetes' strategic merge patch for the fields of a Node and an Event."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if not k.startswith("$")}
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k.startswith("$"):  # $setElementOrder/..., $retainKeys: ordering hints, not data
            continue
        if v is None:
            out.pop(k, None)
            continue
        key = MERGE_KEYS.get((*path, k))
        if key is not None and isinstance(v, list):
            out[k] = _merge_list(out.get(k) or [], v, key, (*path, k))
        elif isinstance(v, dict):
            out[k] = strategic_merge(out.get(k), v, (*path, k))
        else:
            out[k] = copy.deepcopy(v)
    return out


def _merge_list(current: list[Any], items: list[Any], key: str, path: tuple[str, ...]) -> list[Any]:
    result = [copy.deepcopy(x) for x in current]
    for item in items:
        if not isinstance(item, dict) or key not in item:
            raise HTTPError(422, "Invalid", f"{'.'.join(path)}: every item needs its merge key {key!r}")
        at = next((i for i, x in enumerate(result) if isinstance(x, dict) and x.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if at is not None:
                del result[at]
            continue
        if at is None:
            result.append({k: copy.deepcopy(v) for k, v in item.items() if not k.startswith("$")})
        else:
            result[at] = strategic_merge(result[at], item, path)
    return result


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in re.split(r",(?![^()]*\))", selector):
        term = term.strip()
        if not term:
            continue
        m = re.fullmatch(r"(\S+)\s+(in|notin)\s+\(([^)]*)\)", term)
        if m:
            values = {v.strip() for v in m.group(3).split(",")}
            has = m.group(1) in labels and labels[m.group(1)] in values
            if has != (m.group(2) == "in"):
                return False
        elif "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


_UNMANAGED = ("resourceVersion", "managedFields", "uid", "creationTimestamp", "generation", "name", "namespace")


def _field_leaves(obj: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """An object's fields as FieldsV1 paths (`f:spec`, `f:unschedulable`; `k:{"type":"Ready"}` for an item of a
    list with a merge key, `.` for the item itself), each with its value."""
    out: dict[tuple[str, ...], Any] = {}
    if not isinstance(obj, dict):
        return out
    for k, v in obj.items():
        if (not path and k in ("apiVersion", "kind")) or (path == ("f:metadata",) and k in _UNMANAGED):
            continue
        p = (*path, f"f:{k}")
        key = MERGE_KEYS.get(tuple(x[2:] for x in p)) if all(x.startswith("f:") for x in p) else None
        if key is not None and isinstance(v, list):
            for item in v:
                if isinstance(item, dict) and key in item:
                    ip = (*p, "k:" + json.dumps({key: item[key]}, separators=(",", ":")))
                    out[(*ip, ".")] = True
                    out.update(_field_leaves(item, ip))
        elif isinstance(v, dict) and v:
            out.update(_field_leaves(v, p))
        else:
            out[p] = copy.deepcopy(v)
    return out


def _fields_paths(tree: Any, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    if not isinstance(tree, dict) or not tree:
        return {path} if path else set()
    return set().union(*(_fields_paths(v, (*path, k)) for k, v in tree.items()))


def _fields_tree(paths: set[tuple[str, ...]]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for p in sorted(paths):
        at = tree
        for part in p:
            at = at.setdefault(part, {})
    return tree


def _overlaps(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def managed_fields(old: dict[str, Any] | None, new: dict[str, Any], manager: str,
                   subresource: str = "") -> list[dict[str, Any]]:
    """`new`'s metadata.managedFields after `manager` wrote it over `old` (an Update, as the server keeps them)."""
    entries = copy.deepcopy(((old or {}).get("metadata") or {}).get("managedFields") or [])
    before, after = _field_leaves(old or {}), _field_leaves(new)
    missing = object()
    changed = {p for p, v in after.items() if before.get(p, missing) != v}
    removed = set(before) - set(after)
    mine = next((e for e in entries if e.get("manager") == manager and e.get("operation") == "Update"
                 and e.get("subresource", "") == subresource), None)
    if mine is None and changed:
        mine = {"manager": manager, "operation": "Update", "apiVersion": "v1", "fieldsType": "FieldsV1",
                "fieldsV1": {}, **({"subresource": subresource} if subresource else {})}
        entries.append(mine)
    kept = []
    for e in entries:
        paths = {q for q in _fields_paths(e.get("fieldsV1") or {})
                 if not any(_overlaps(q, p) for p in removed) and (e is mine or not any(_overlaps(q, p)
                                                                                       for p in changed))}
        if e is mine:
            paths |= changed
            if changed:
                e["time"] = now_rfc3339()
        if paths:
            e["fieldsV1"] = _fields_tree(paths)
            kept.append(e)
    return kept


def _accepts(accept: str) -> str:
    """What a list answers for this Accept header, as the server negotiates it: the first media range it can
    serve, "metadata" (a PartialObjectMetadataList) or "object" (the whole list); 406 when none."""
    for media in (accept or "application/json").split(","):
        kind, *params = [x.strip() for x in media.split(";")]
        opts = dict(p.split("=", 1) for p in params if "=" in p)
        if kind not in ("application/json", "application/*", "*/*"):
            continue
        if "as" not in opts:
            return "object"
        if (opts.get("as"), opts.get("g"), opts.get("v")) == ("PartialObjectMetadataList", "meta.k8s.io", "v1"):
            return "metadata"
    raise HTTPError(406, "NotAcceptable", f"only the following media types are accepted: application/json, "
                                          f"application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1 "
                                          f"(asked: {accept[:200]})")


def _validate_node(node: dict[str, Any]) -> None:
    for c in (node.get("status") or {}).get("conditions") or []:
        if not c.get("type") or c.get("status") not in ("True", "False", "Unknown"):
            raise HTTPError(422, "Invalid", f"status.conditions: invalid condition {c!r}: type and status "
                                            "(True, False or Unknown) are required")
    seen = set()
    for t in (node.get("spec") or {}).get("taints") or []:
        if not t.get("key") or t.get("effect") not in TAINT_EFFECTS:
            raise HTTPError(422, "Invalid", f"spec.taints: invalid taint {t!r}")
        if (t["key"], t["effect"]) in seen:
            raise HTTPError(422, "Invalid", f"spec.taints: duplicate taint {t['key']}:{t['effect']}")
        seen.add((t["key"], t["effect"]))


class KubeAPIServer:
    """Start it, add nodes, point a kubeconfig at it; read back the nodes, events and the request log."""

    def __init__(self, tokens: dict[str, set[tuple[str, str]] | str] | None = None):
        self.tokens: dict[str, set[tuple[str, str]] | str] = tokens if tokens is not None else {"admin": ALL}
        self.state = State()
        self.lock = threading.Lock()
        self.log: list[Request] = []
        self.faults: list[Fault] = []
        self.before_write: dict[str, Callable[[dict[str, Any]], None]] = {}
        self.stopping = threading.Event()
        self.httpd: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    # --- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> KubeAPIServer:
        server = self

        class Handler(_Handler):
            api = server

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="kube-apiserver", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        if self.thread is not None:
            self.thread.join(5)

    @property
    def url(self) -> str:
        assert self.httpd is not None
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def kubeconfig(self, path: Path, token: str = "admin") -> Path:
        doc = {"apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
               "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
               "users": [{"name": "robustd", "user": {"token": token}}],
               "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "robustd"}}]}
        path.write_text(yaml.safe_dump(doc))
        return path

    # --- the cluster's contents ---------------------------------------------------------------------

    def add_node(self, name: str, labels: dict[str, str] | None = None, unschedulable: bool = False,
                 taints: list[dict[str, Any]] | None = None, conditions: list[dict[str, Any]] | None = None,
                 annotations: dict[str, str] | None = None) -> None:
        with self.lock:
            self.state.rv += 1
            spec: dict[str, Any] = {"podCIDR": "10.244.0.0/24"}
            if unschedulable:
                spec["unschedulable"] = True
            if taints:
                spec["taints"] = copy.deepcopy(taints)
            ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting "
                     "ready status", "lastHeartbeatTime": now_rfc3339(), "lastTransitionTime": "2026-01-01T00:00:00Z"}
            self.state.nodes[name] = {
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": str(self.state.rv),
                             "creationTimestamp": "2026-01-01T00:00:00Z",
                             "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                             "annotations": dict(annotations or {})},
                "spec": spec,
                "status": {"conditions": [ready, *copy.deepcopy(conditions or [])],
                           "addresses": [{"type": "Hostname", "address": name}],
                           "nodeInfo": {"architecture": "amd64", "bootID": f"boot-{name}",
                                        "containerRuntimeVersion": "containerd://2.1.0", "kernelVersion": "6.12.0",
                                        "kubeProxyVersion": "", "kubeletVersion": "v1.34.0",
                                        "machineID": f"machine-{name}", "operatingSystem": "linux",
                                        "osImage": "Debian GNU/Linux 12 (bookworm)", "systemUUID": f"uuid-{name}"},
                           "futureField": {"kept": True}}}  # a field this client version does not know
            node = self.state.nodes[name]
            node["metadata"]["managedFields"] = managed_fields(None, node, "kubelet")

    def node(self, name: str) -> dict[str, Any]:
        with self.lock:
            return copy.deepcopy(self.state.nodes[name])

    def edit_node(self, name: str, fn: Callable[[dict[str, Any]], None], manager: str = "kubectl-edit") -> None:
        """Another actor's write (an operator's kubectl, as field manager `manager`): applied now, with a new
        resourceVersion."""
        with self.lock:
            self._write_by(name, fn, manager)

    def _write_by(self, name: str, fn: Callable[[dict[str, Any]], None], manager: str) -> None:
        old = copy.deepcopy(self.state.nodes[name])
        fn(self.state.nodes[name])
        self.state.rv += 1
        node = self.state.nodes[name]
        node["metadata"]["resourceVersion"] = str(self.state.rv)
        node["metadata"]["managedFields"] = managed_fields(old, node, manager)

    def condition(self, node: str, ctype: str) -> dict[str, Any] | None:
        for c in self.node(node)["status"].get("conditions") or []:
            if c["type"] == ctype:
                return dict(c)
        return None

    def events(self, namespace: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [copy.deepcopy(e) for (ns, _), e in self.state.events.items() if namespace in (None, ns)]

    def requests(self, method: str | None = None, contains: str = "") -> list[Request]:
        with self.lock:
            return [r for r in self.log if method in (None, r.method) and contains in r.path]

    # --- faults -------------------------------------------------------------------------------------

    def fail(self, what: int | str, count: int | None = 1, seconds: float | None = None, method: str | None = None,
             path: str = "", hold: float = 30.0, retry_after: int | None = None) -> None:
        """The next `count` requests (or all for `seconds`) matching method/path answer `what` (or time out)."""

        def match(m: str, p: str) -> bool:
            return method in (None, m) and path in p

        with self.lock:
            self.faults.append(Fault(what, None if seconds is not None else count,
                                     time.monotonic() + seconds if seconds is not None else None, match, hold,
                                     retry_after))

    def heal(self) -> None:
        with self.lock:
            self.faults.clear()

    def on_next_write(self, name: str, fn: Callable[[dict[str, Any]], None]) -> None:
        """Just before the next PUT or PATCH of node `name` (not its status), another writer changes it (fn on
        the stored node, with a new resourceVersion, as field manager `another-controller`), as a controller
        writing between our GET and our write."""
        with self.lock:
            self.before_write[name] = fn

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self.lock:
            now = time.monotonic()
            self.faults = [f for f in self.faults if (f.count is None or f.count > 0)
                           and (f.until is None or f.until > now)]
            for f in self.faults:
                if f.match(method, path):
                    if f.count is not None:
                        f.count -= 1
                    return f
        return None

    # --- the API ------------------------------------------------------------------------------------

    def handle(self, req: Request) -> tuple[int, Any]:
        parts = [p for p in req.path.split("/") if p]
        if parts[:2] != ["api", "v1"]:
            raise HTTPError(404, "NotFound", f"the server could not find the requested resource ({req.path})")
        rest = parts[2:]
        if rest[:1] == ["nodes"]:
            name = rest[1] if len(rest) > 1 else None
            sub = rest[2] if len(rest) > 2 else None
            if len(rest) > 3 or sub not in (None, "status"):
                raise HTTPError(404, "NotFound", f"the server could not find the requested resource ({req.path})")
            req.resource = "nodes/status" if sub else "nodes"
            req.verb = {"GET": "get" if name else "list", "PATCH": "patch", "PUT": "update", "POST": "create",
                        "DELETE": "delete"}.get(req.method, "")
            self._authorize(req, name or "")
            return self._nodes(req, name, sub == "status")
        if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] == "events" and len(rest) <= 4:
            ns, name = rest[1], (rest[3] if len(rest) == 4 else None)
            req.resource = "events"
            req.verb = {"GET": "get" if name else "list", "PATCH": "patch", "PUT": "update", "POST": "create",
                        "DELETE": "delete"}.get(req.method, "")
            self._authorize(req, name or "")
            return self._events(req, ns, name)
        raise HTTPError(404, "NotFound", f"the server could not find the requested resource ({req.path})")

    def _authorize(self, req: Request, name: str) -> None:
        allowed = self.tokens.get(req.token)
        if allowed is None:
            raise HTTPError(401, "Unauthorized", "Unauthorized")
        if allowed != ALL and (req.verb, req.resource) not in allowed:
            res, _, sub = req.resource.partition("/")
            what = f'{res} "{name}" is forbidden' if name else f"{res} is forbidden"
            raise HTTPError(403, "Forbidden", f'{what}: User "system:serviceaccount:robustd:{req.token}" cannot '
                                              f'{req.verb} resource "{res}"' + (f' subresource "{sub}"' if sub
                                                                                 else "") + " in API group \"\"")

    def _nodes(self, req: Request, name: str | None, status: bool) -> tuple[int, Any]:
        with self.lock:
            if name is None:
                if req.method != "GET":
                    raise HTTPError(405, "MethodNotAllowed", f"{req.method} is not supported on nodes")
                sel = req.query.get("labelSelector", "")
                items = [copy.deepcopy(n) for n in self.state.nodes.values()
                         if _selector_matches(sel, n["metadata"].get("labels") or {})]
                if _accepts(req.accept) == "metadata":
                    return 200, {"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList",
                                 "metadata": {"resourceVersion": str(self.state.rv)},
                                 "items": [{"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                                            "metadata": n["metadata"]} for n in items]}
                return 200, {"apiVersion": "v1", "kind": "NodeList",
                             "metadata": {"resourceVersion": str(self.state.rv)}, "items": items}
            if name not in self.state.nodes:
                raise HTTPError(404, "NotFound", f'nodes "{name}" not found')
            if req.method == "GET":
                return 200, copy.deepcopy(self.state.nodes[name])
            if req.method in ("PUT", "PATCH") and not status and name in self.before_write:
                self._write_by(name, self.before_write.pop(name), "another-controller")
            current = self.state.nodes[name]
            if req.method == "PATCH":
                new = self._patched(req, current, f'nodes "{name}"')
            elif req.method == "PUT":
                new = copy.deepcopy(req.body) if isinstance(req.body, dict) else None
                if new is None or (new.get("metadata") or {}).get("name") != name:
                    raise HTTPError(400, "BadRequest", "the name of the object does not match the name on the URL")
                self._precondition(new, current, f'nodes "{name}"')
            else:
                raise HTTPError(405, "MethodNotAllowed", f"{req.method} is not supported on a node")
            if status:  # the status subresource: only .status changes
                new = {**copy.deepcopy(current), "status": new.get("status") or {}}
            else:  # the main resource: .status is not changed by it
                new["status"] = copy.deepcopy(current.get("status") or {})
                for k in ("uid", "creationTimestamp"):
                    new.setdefault("metadata", {})[k] = current["metadata"][k]
            _validate_node(new)
            new["metadata"]["name"] = name
            new["metadata"]["managedFields"] = copy.deepcopy(current["metadata"].get("managedFields") or [])
            if new != current:
                new["metadata"]["managedFields"] = managed_fields(current, new, req.field_manager,
                                                                  "status" if status else "")
                self.state.rv += 1
                new["metadata"]["resourceVersion"] = str(self.state.rv)
                self.state.nodes[name] = new
            return 200, copy.deepcopy(self.state.nodes[name])

    def _patched(self, req: Request, current: dict[str, Any], what: str) -> dict[str, Any]:
        ct = req.content_type.split(";")[0].strip()
        if ct == JSONPATCH:
            if not isinstance(req.body, list):
                raise HTTPError(400, "BadRequest", "a JSON patch must be a list of operations")
            try:
                new = jsonpatch.apply_patch(current, req.body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                code = 422 if isinstance(e, jsonpatch.JsonPatchTestFailed) else 400
                raise HTTPError(code, "Invalid", f"the server rejected our request due to an error in our "
                                                 f"request: {e}") from None
            if new["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                self._precondition(new, current, what)
            return dict(new)
        if not isinstance(req.body, dict):
            raise HTTPError(400, "BadRequest", "the body of a patch must be a JSON object")
        if ct == SMP:
            new = strategic_merge(current, req.body)
        elif ct == MERGE:
            new = merge_patch(current, req.body)
        else:
            raise HTTPError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                                                         f"accepted media types include: {JSONPATCH}, {MERGE}, {SMP}")
        rv = (req.body.get("metadata") or {}).get("resourceVersion")
        if rv is not None:
            self._precondition({"metadata": {"resourceVersion": rv}}, current, what)
        return dict(new)

    @staticmethod
    def _precondition(new: dict[str, Any], current: dict[str, Any], what: str) -> None:
        rv = (new.get("metadata") or {}).get("resourceVersion")
        if rv and rv != current["metadata"]["resourceVersion"]:
            raise HTTPError(409, "Conflict", f"Operation cannot be fulfilled on {what}: the object has been "
                                             "modified; please apply your changes to the latest version and try again")
        new.setdefault("metadata", {})["resourceVersion"] = current["metadata"]["resourceVersion"]

    def _events(self, req: Request, ns: str, name: str | None) -> tuple[int, Any]:
        with self.lock:
            if req.method == "GET" and name is None:
                items = [copy.deepcopy(e) for (n, _), e in self.state.events.items() if n == ns]
                return 200, {"apiVersion": "v1", "kind": "EventList", "items": items}
            if req.method == "POST" and name is None:
                ev = req.body if isinstance(req.body, dict) else None
                if ev is None or not (ev.get("metadata") or {}).get("name"):
                    raise HTTPError(422, "Invalid", "Event: metadata.name: Required value")
                if ev["metadata"].get("namespace", ns) != ns:
                    raise HTTPError(400, "BadRequest", "the namespace of the object does not match the URL")
                if not ev.get("involvedObject"):
                    raise HTTPError(422, "Invalid", "Event: involvedObject: Required value")
                key = (ns, ev["metadata"]["name"])
                if key in self.state.events:
                    raise HTTPError(409, "AlreadyExists", f'events "{key[1]}" already exists')
                self.state.rv += 1
                ev = copy.deepcopy(ev)
                ev["metadata"].update(namespace=ns, resourceVersion=str(self.state.rv))
                ev["metadata"]["managedFields"] = managed_fields(None, ev, req.field_manager)
                self.state.events[key] = ev
                return 201, copy.deepcopy(ev)
            if name is None or (ns, name) not in self.state.events:
                raise HTTPError(404, "NotFound", f'events "{name}" not found')
            if req.method == "GET":
                return 200, copy.deepcopy(self.state.events[(ns, name)])
            if req.method == "PATCH":
                cur = self.state.events[(ns, name)]
                new = self._patched(req, cur, f'events "{name}"')
                new["metadata"]["managedFields"] = managed_fields(cur, new, req.field_manager)
                self.state.rv += 1
                new["metadata"]["resourceVersion"] = str(self.state.rv)
                self.state.events[(ns, name)] = new
                return 200, copy.deepcopy(new)
            raise HTTPError(405, "MethodNotAllowed", f"{req.method} is not supported on an event")


class _Handler(BaseHTTPRequestHandler):
    api: KubeAPIServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def _serve(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        auth = self.headers.get("Authorization", "")
        req = Request(self.command, url.path, query, self.headers.get("Content-Type", ""), None,
                      auth.removeprefix("Bearer ").strip(), accept=self.headers.get("Accept", ""))
        # The server's default manager: the User-Agent up to its first `/` ("OpenAPI-Generator" for this client).
        req.field_manager = query.get("fieldManager") or self.headers.get("User-Agent", "").split("/")[0][:128]
        try:
            if len(req.field_manager) > 128 or not req.field_manager.isprintable():
                raise HTTPError(422, "Invalid", "metadata.managedFields.manager: Too long: may not be more than 128 "
                                                "bytes" if len(req.field_manager) > 128 else
                                "metadata.managedFields.manager: Invalid value: not printable")
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                raise HTTPError(413, "RequestEntityTooLarge", "the request is too large")
            raw = self.rfile.read(length) if length else b""
            if raw:
                try:
                    req.body = json.loads(raw)
                except ValueError:
                    raise HTTPError(400, "BadRequest", "the body is not JSON") from None
            if req.method in ("POST", "PUT") and req.content_type.split(";")[0].strip() != "application/json":
                # kube-apiserver takes an empty Content-Type for application/octet-stream, which it cannot decode
                raise HTTPError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - "
                                                             "accepted media types include: application/json")
            fault = self.api._take_fault(req.method, req.path)
            if fault is not None and fault.what == "timeout":
                req.status = -1  # never answered
                with self.api.lock:
                    self.api.log.append(req)
                self.api.stopping.wait(fault.hold)
                self.close_connection = True
                return
            if fault is not None:
                assert isinstance(fault.what, int)
                headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
                raise HTTPError(fault.what, {429: "TooManyRequests", 500: "InternalError"}.get(fault.what, "Failure"),
                                "injected failure", headers)
            code, body = self.api.handle(req)
            self._answer(req, code, body, {})
        except HTTPError as e:
            status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": e.message, "reason": e.reason, "code": e.code}
            self._answer(req, e.code, status, e.headers)

    def _answer(self, req: Request, code: int, body: Any, headers: dict[str, str]) -> None:
        req.status = code
        with self.api.lock:
            self.api.log.append(req)
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve
