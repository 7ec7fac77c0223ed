"""Inter-machine all-gather through the gRPC API: three daemons, each in its own network
namespace, joined by veth links to a bridge, as three hosts on one switch."""

from __future__ import annotations

import threading
import uuid
from typing import Any, Iterator

import pytest
from conftest import Daemon, need_root
from netns_fabric import Fabric

from robustd.api.v1 import robustd_pb2 as pb
from robustd.api.v1 import robustd_pb2_grpc as pb_grpc

NODES = 3


@pytest.fixture
def fabric() -> Iterator[list[tuple[str, str]]]:
    """[(netns name, address)] for NODES hosts on one bridge."""
    need_root("network namespaces")
    with Fabric(NODES, prefix="rdag") as f:
        yield [(h.ns, h.addr) for h in f.hosts]


def start_nodes(make_daemon: Any, hosts: list[tuple[str, str]]) -> list[Daemon]:
    nodes = []
    for i, (ns, _) in enumerate(hosts):
        d = make_daemon({"node_name": f"node-{i}", "checks": {"kernel": {"enabled": False}},
                         "diagnostics": {"test_faults": True, "collectives": {"timeout": "40s"}}}, name=f"n{i}")
        d.wrap = ["ip", "netns", "exec", ns]
        d.start()
        nodes.append(d)
    return nodes


def all_gather(nodes: list[Daemon], master: str, faults: dict[int, str]) -> list[pb.DiagnosticReport]:
    port = 29000 + uuid.uuid4().int % 2000
    reports: list[pb.DiagnosticReport | None] = [None] * len(nodes)

    def one(i: int) -> None:
        req = pb.RunRequest(tests=["all_gather"], test_faults_json=faults.get(i, ""),
                            rendezvous=pb.Rendezvous(master_addr=master, master_port=port, world_size=len(nodes),
                                                     node_rank=i, run_id="job-7"))
        with nodes[i].channel() as ch:
            msgs = list(pb_grpc.DiagnosticsStub(ch).Run(req, timeout=120))
        reports[i] = msgs[-1].report

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert all(r is not None for r in reports)
    return [r for r in reports if r is not None]


def peers(report: pb.DiagnosticReport, status: int) -> set[str]:
    return {x.component for x in report.results if x.test == "all_gather" and x.status == status}


def test_all_gather_across_namespaces_names_only_the_corrupt_node(make_daemon: Any,
                                                                  fabric: list[tuple[str, str]]) -> None:
    nodes = start_nodes(make_daemon, fabric)
    master = fabric[0][1]
    healthy = all_gather(nodes, master, {})
    for i, r in enumerate(healthy):
        assert r.outcome == pb.OUTCOME_PASS, r
        assert peers(r, pb.RESULT_PASS) == {f"node/node-{j}" for j in range(NODES) if j != i}

    reports = all_gather(nodes, master, {1: '{"all_gather": {"corrupt_node": true}}'})
    for i in (0, 2):
        assert reports[i].outcome == pb.OUTCOME_FAIL, reports[i]
        assert list(reports[i].suspects) == ["node/node-1"]
        v = nodes[i].verdict()
        assert [(c.component, c.code) for c in v.conditions] == [("node/node-1", "DIAG_ALL_GATHER_FAILED")]
    assert "node/node-1" not in reports[1].suspects
