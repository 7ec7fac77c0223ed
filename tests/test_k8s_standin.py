"""The kube-apiserver stand-in keeps Kubernetes' semantics: checked through the official client, as robustd-k8s
talks to it (if the stand-in drifted from the real server, the agent's tests would prove nothing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest
import urllib3
from fakes.kube_apiserver import JSONPATCH, MERGE, SMP, KubeAPIServer
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from robustd.adapters.k8s.kube import api_client

NODE = "n1"


@pytest.fixture
def server() -> Iterator[KubeAPIServer]:
    s = KubeAPIServer(tokens={"admin": "*", "reader": {("get", "nodes")}}).start()
    s.add_node(NODE)
    yield s
    s.stop()


def core(server: KubeAPIServer, tmp: Path, token: str = "admin") -> client.CoreV1Api:
    return client.CoreV1Api(api_client(str(server.kubeconfig(tmp / f"{token}.kc", token))))


def types(server: KubeAPIServer) -> list[tuple[str, str]]:
    return [(c["type"], c["status"]) for c in server.node(NODE)["status"]["conditions"]]


def test_strategic_merge_patch_merges_conditions_by_type(server: KubeAPIServer, tmp_path: Path) -> None:
    api = core(server, tmp_path)
    api.patch_node_status(NODE, {"status": {"conditions": [{"type": "A", "status": "True"}]}}, _content_type=SMP)
    api.patch_node_status(NODE, {"status": {"conditions": [{"type": "B", "status": "False"},
                                                           {"type": "A", "status": "False", "reason": "Fixed"}]}},
                          _content_type=SMP)
    assert types(server) == [("Ready", "True"), ("A", "False"), ("B", "False")]
    api.patch_node_status(NODE, {"status": {"conditions": [{"type": "B", "$patch": "delete"}]}}, _content_type=SMP)
    assert types(server) == [("Ready", "True"), ("A", "False")]
    api.patch_node_status(NODE, {"spec": {"unschedulable": True}, "status": {"conditions": []}}, _content_type=SMP)
    assert not server.node(NODE)["spec"].get("unschedulable")  # the status subresource changes only .status
    r = server.requests("PATCH")[0]
    assert r.content_type == SMP and r.body == {"status": {"conditions": [{"type": "A", "status": "True"}]}}
    with pytest.raises(ApiException) as e:
        api.patch_node_status(NODE, {"status": {"conditions": [{"type": "C", "status": "Maybe"}]}},
                              _content_type=SMP)
    assert e.value.status == 422


def test_merge_patch_replaces_lists_and_null_deletes(server: KubeAPIServer, tmp_path: Path) -> None:
    api = core(server, tmp_path)
    api.patch_node(NODE, {"spec": {"taints": [{"key": "a", "effect": "NoSchedule"}]},
                          "metadata": {"annotations": {"x": "1", "y": "2"}}}, _content_type=MERGE)
    api.patch_node(NODE, {"spec": {"taints": [{"key": "b", "effect": "NoExecute"}]},
                          "metadata": {"annotations": {"x": None}}}, _content_type=MERGE)
    node = server.node(NODE)
    assert node["spec"]["taints"] == [{"key": "b", "effect": "NoExecute"}]
    assert node["metadata"]["annotations"] == {"y": "2"}
    api.patch_node_status(NODE, {"status": {"conditions": [{"type": "A", "status": "True"}]}}, _content_type=MERGE)
    assert types(server) == [("A", "True")]  # no merge key in a JSON merge patch: the list is replaced
    with pytest.raises(ApiException) as e:  # a patch naming a stale resourceVersion
        api.patch_node(NODE, {"metadata": {"resourceVersion": "1"}, "spec": {"unschedulable": True}},
                       _content_type=MERGE)
    assert e.value.status == 409 and "the object has been modified" in e.value.body


def test_json_patch(server: KubeAPIServer, tmp_path: Path) -> None:
    api = core(server, tmp_path)
    rv = server.node(NODE)["metadata"]["resourceVersion"]
    api.patch_node(NODE, [{"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                          {"op": "add", "path": "/spec/unschedulable", "value": True}], _content_type=JSONPATCH)
    assert server.node(NODE)["spec"]["unschedulable"] is True
    with pytest.raises(ApiException) as e:  # the same test again: the resourceVersion moved on
        api.patch_node(NODE, [{"op": "test", "path": "/metadata/resourceVersion", "value": rv}],
                       _content_type=JSONPATCH)
    assert e.value.status == 422
    assert server.requests("PATCH")[0].content_type == JSONPATCH


def test_put_with_a_stale_resource_version_is_a_conflict(server: KubeAPIServer, tmp_path: Path) -> None:
    api = core(server, tmp_path)
    node = api.read_node(NODE)
    node.spec.unschedulable = True
    server.edit_node(NODE, lambda n: n["metadata"]["labels"].update(other="write"))
    with pytest.raises(ApiException) as e:
        api.replace_node(NODE, node, _headers={"Content-Type": "application/json"})
    assert e.value.status == 409
    node = api.read_node(NODE)
    node.spec.unschedulable = True
    api.replace_node(NODE, node, _headers={"Content-Type": "application/json"})
    stored = server.node(NODE)
    assert stored["spec"]["unschedulable"] is True and stored["metadata"]["labels"]["other"] == "write"
    put = server.requests("PUT")[-1]
    assert put.status == 200 and put.body["metadata"]["resourceVersion"] == node.metadata.resource_version


def test_not_found_forbidden_unauthorized(server: KubeAPIServer, tmp_path: Path) -> None:
    with pytest.raises(ApiException) as e:
        core(server, tmp_path).read_node("nope")
    assert e.value.status == 404 and 'nodes \\"nope\\" not found' in e.value.body
    reader = core(server, tmp_path, "reader")
    assert reader.read_node(NODE).metadata.name == NODE
    with pytest.raises(ApiException) as e:
        reader.patch_node_status(NODE, {"status": {}}, _content_type=SMP)
    assert e.value.status == 403 and 'cannot patch resource \\"nodes\\" subresource \\"status\\"' in e.value.body
    with pytest.raises(ApiException) as e:
        core(server, tmp_path, "stranger").read_node(NODE)
    assert e.value.status == 401


def test_injected_failures(server: KubeAPIServer, tmp_path: Path) -> None:
    api = core(server, tmp_path)
    server.fail(429, count=1, retry_after=3)
    server.fail(500, count=1)
    with pytest.raises(ApiException) as e:
        api.read_node(NODE)
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "3"
    with pytest.raises(ApiException) as e:
        api.read_node(NODE)
    assert e.value.status == 500
    server.fail("timeout", count=1, hold=2.0)
    with pytest.raises(urllib3.exceptions.HTTPError):
        api.read_node(NODE, _request_timeout=0.3)
    assert api.read_node(NODE).metadata.name == NODE  # and then it answers again
    assert [r.status for r in server.log] == [429, 500, -1, 200]


def test_events_create_conflict_and_patch(server: KubeAPIServer, tmp_path: Path) -> None:
    api = core(server, tmp_path)
    ev = {"metadata": {"name": "n1.1"}, "involvedObject": {"kind": "Node", "name": NODE}, "reason": "R",
          "message": "m", "type": "Warning", "count": 1}
    api.create_namespaced_event("default", ev, _headers={"Content-Type": "application/json"})
    with pytest.raises(ApiException) as e:
        api.create_namespaced_event("default", ev, _headers={"Content-Type": "application/json"})
    assert e.value.status == 409 and "AlreadyExists" in e.value.body
    with pytest.raises(ApiException) as e:  # this client sends no Content-Type on a POST unless told
        api.create_namespaced_event("default", {**ev, "metadata": {"name": "n1.2"}})
    assert e.value.status == 415
    api.patch_namespaced_event("n1.1", "default", {"count": 2}, _content_type=SMP)
    (stored,) = server.events("default")
    assert stored["count"] == 2 and stored["reason"] == "R"
    with pytest.raises(ApiException) as e:
        api.patch_namespaced_event("gone", "default", {"count": 2}, _content_type=SMP)
    assert e.value.status == 404


def test_managed_fields_follow_each_managers_writes(server: KubeAPIServer, tmp_path: Path) -> None:
    """As the real server keeps them: a manager per field set (fieldManager, else the User-Agent's first word),
    operation Update, the status subresource apart; a changed field changes hands, an unchanged one does not, a
    removed one belongs to no one."""
    api = core(server, tmp_path)

    def managers() -> dict[tuple[str, str], dict]:
        return {(m.manager, m.subresource or ""): m.fields_v1 for m in api.read_node(NODE).metadata.managed_fields}

    assert managers()[("kubelet", "")]["f:status"]["f:conditions"]['k:{"type":"Ready"}']["."] == {}
    api.patch_node(NODE, {"spec": {"unschedulable": True}}, field_manager="kubectl-cordon", _content_type=SMP)
    assert managers()[("kubectl-cordon", "")] == {"f:spec": {"f:unschedulable": {}}}
    entry = next(m for m in api.read_node(NODE).metadata.managed_fields if m.manager == "kubectl-cordon")
    assert entry.operation == "Update" and entry.api_version == "v1" and entry.fields_type == "FieldsV1"
    api.patch_node(NODE, {"spec": {"unschedulable": True, "taints": [{"key": "a", "effect": "NoSchedule"}]}},
                   field_manager="robustd-k8s", _content_type=MERGE)
    got = managers()
    assert got[("robustd-k8s", "")] == {"f:spec": {"f:taints": {}}}  # unschedulable was written unchanged
    assert got[("kubectl-cordon", "")] == {"f:spec": {"f:unschedulable": {}}}
    api.patch_node_status(NODE, {"status": {"conditions": [{"type": "A", "status": "True"}]}},
                          field_manager="robustd-k8s", _content_type=SMP)
    assert managers()[("robustd-k8s", "status")] == {"f:status": {"f:conditions": {'k:{"type":"A"}': {
        ".": {}, "f:status": {}, "f:type": {}}}}}
    api.patch_node(NODE, {"spec": {"unschedulable": None}}, field_manager="kubectl-cordon", _content_type=SMP)
    assert ("kubectl-cordon", "") not in managers()  # it removed its only field
    api.patch_node(NODE, {"spec": {"unschedulable": True}}, _content_type=SMP)  # no fieldManager: the User-Agent's
    assert managers()[("OpenAPI-Generator", "")] == {"f:spec": {"f:unschedulable": {}}}
    assert server.requests("PATCH")[-1].field_manager == "OpenAPI-Generator"
    with pytest.raises(ApiException) as e:
        api.patch_node(NODE, {"spec": {"unschedulable": False}}, field_manager="x" * 129, _content_type=SMP)
    assert e.value.status == 422


def test_a_node_list_in_metadata_only(server: KubeAPIServer, tmp_path: Path) -> None:
    """The Accept header kubectl sends for metadata: a PartialObjectMetadataList, items with only metadata."""
    server.add_node("n2", labels={"gpu": "yes"}, annotations={"a": "1"})
    api = core(server, tmp_path)
    meta = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
    resp = api.list_node(label_selector="gpu=yes", _preload_content=False,
                         _headers={"Accept": f"{meta},application/json"})
    body = json.loads(resp.read())
    assert (body["kind"], body["apiVersion"]) == ("PartialObjectMetadataList", "meta.k8s.io/v1")
    (item,) = body["items"]
    assert set(item) == {"kind", "apiVersion", "metadata"} and item["kind"] == "PartialObjectMetadata"
    assert item["metadata"]["name"] == "n2" and item["metadata"]["annotations"] == {"a": "1"}
    assert [n.metadata.name for n in api.list_node().items] == [NODE, "n2"]  # the default: whole Nodes
    assert api.list_node().items[0].status.node_info.kubelet_version == "v1.34.0"
    with pytest.raises(ApiException) as e:
        api.list_node(_headers={"Accept": "application/json;as=Table;g=meta.k8s.io;v=v1"})
    assert e.value.status == 406
    assert server.requests("GET")[0].accept == f"{meta},application/json"
