"""deploy/kubernetes/: the manifests load into the official client's model classes, and the ClusterRole grants
exactly the verbs and resources robustd-k8s uses on the wire (no more, no less); the `k8s:` config section is
validated like the rest of robustd.yaml. No image can be built or pulled here, so nothing is run in a cluster.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO
from fakes.kube_apiserver import KubeAPIServer
from kubernetes import client

from robustd.adapters.common.model import RAISED, Cond, Table
from robustd.adapters.k8s.config import SCHEMA, K8sConfig
from robustd.adapters.k8s.families import event_for
from robustd.adapters.k8s.kube import Kube, api_client
from robustd.adapters.k8s.reconciler import Reconciler
from robustd.adapters.k8s.state import K8sState, K8sStateFile
from robustd.config import ConfigError, load_config
from robustd.model import Action, Severity

DEPLOY = REPO / "deploy" / "kubernetes"
MODELS = {"DaemonSet": client.V1DaemonSet, "ServiceAccount": client.V1ServiceAccount,
          "ClusterRole": client.V1ClusterRole, "ClusterRoleBinding": client.V1ClusterRoleBinding,
          "Namespace": client.V1Namespace}
XID = Cond("gpu/0000:1b:00.0", "XID_79", Severity.CRITICAL, Action.REBOOT, 5)


def manifests() -> dict[str, Any]:
    docs: dict[str, Any] = {}
    for f in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                docs[doc["kind"]] = MODELS[doc["kind"]].from_dict(doc)  # strict: an unknown field is an error
    return docs


def test_manifests_load_into_the_clients_models() -> None:
    docs = manifests()
    assert set(docs) == set(MODELS)
    ds: client.V1DaemonSet = docs["DaemonSet"]
    pod = ds.spec.template.spec
    sa: client.V1ServiceAccount = docs["ServiceAccount"]
    binding: client.V1ClusterRoleBinding = docs["ClusterRoleBinding"]
    assert pod.service_account_name == sa.metadata.name and ds.metadata.namespace == sa.metadata.namespace
    assert binding.role_ref.name == docs["ClusterRole"].metadata.name
    assert (binding.subjects[0].name, binding.subjects[0].namespace) == (sa.metadata.name, sa.metadata.namespace)
    (c,) = pod.containers
    env = {e.name: e for e in c.env}
    assert env["NODE_NAME"].value_from.field_ref.field_path == "spec.nodeName"
    mounts = {m.mount_path: m for m in c.volume_mounts}
    assert {"/etc/robustd", "/run/robustd", "/var/lib/robustd"} <= set(mounts)  # config, socket, state
    assert mounts["/etc/robustd"].read_only
    assert c.args == ["--config", "/etc/robustd/robustd.yaml"]
    assert not c.security_context.allow_privilege_escalation and c.security_context.capabilities.drop == ["ALL"]
    assert ds.spec.selector.match_labels.items() <= ds.spec.template.metadata.labels.items()
    assert any(t.operator == "Exists" and t.key is None for t in pod.tolerations)  # runs on quarantined nodes too
    text = (DEPLOY / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["/opt/robustd/bin/robustd-k8s"]' in text and c.image.startswith("registry.example.com/")


def scenario(server: KubeAPIServer, tmp: Path, token: str) -> None:
    """Everything robustd-k8s does to a cluster: read, conditions, events (new and counted up), the breaker's
    count, cordon and taint, release."""
    t = [1_800_000_000.0]
    tmp.mkdir()
    kube = Kube(api_client(str(server.kubeconfig(tmp / f"{token}.kubeconfig", token))), 2.0)
    cfg = K8sConfig(quarantine={"actions": ["REBOOT"], "max_fraction": 1.0, "release_after": "1m"})
    r = Reconciler(cfg, kube, "gpu-1", K8sStateFile(str(tmp / f"{token}.json")), K8sState(), clock=lambda: t[0],
                   rng=random.Random(1))
    busy = Table(seq=5, conditions={XID.key: XID})
    for seq in (5, 6):
        r.queue(event_for(RAISED, XID, seq))  # type: ignore[arg-type]
        assert r.step(busy) >= 0 and not r.last_error, r.last_error
    r.step(Table(seq=7))
    t[0] += 61
    r.step(Table(seq=7))
    assert not r.last_error, r.last_error
    assert not server.node("gpu-1")["spec"].get("taints")  # released again


def run_scenario(tmp: Path, token: str, granted: set[tuple[str, str]]) -> KubeAPIServer:
    server = KubeAPIServer(tokens={"admin": "*", "robustd-k8s": granted}).start()
    try:
        server.add_node("gpu-1")
        scenario(server, tmp, token)
        return server
    finally:
        server.stop()


def test_cluster_role_grants_exactly_what_the_agent_uses(tmp_path: Path) -> None:
    role: client.V1ClusterRole = manifests()["ClusterRole"]
    granted = {(verb, res) for rule in role.rules for res in rule.resources for verb in rule.verbs}
    assert all(rule.api_groups == [""] for rule in role.rules)  # the core group: nodes, nodes/status, events
    used = {(r.verb, r.resource) for r in run_scenario(tmp_path / "a", "admin", granted).log}
    assert used == granted, f"used, not granted: {used - granted}; granted, not used: {granted - used}"
    server = run_scenario(tmp_path / "b", "robustd-k8s", granted)  # a token holding exactly the ClusterRole
    assert {r.status for r in server.log} <= {200, 201}
    with pytest.raises(AssertionError, match="403 Forbidden"):
        run_scenario(tmp_path / "c", "robustd-k8s", granted - {("patch", "nodes/status")})


def write(tmp: Path, text: str) -> str:
    p = tmp / "robustd.yaml"
    p.write_text(text)
    return str(p)


def test_k8s_config_defaults_and_errors_name_key_and_line(tmp_path: Path) -> None:
    s = load_config(write(tmp_path, "k8s:\n"), SCHEMA)
    assert s.section("k8s") == load_config(str(REPO / "etc" / "robustd-k8s.example.yaml"),
                                          SCHEMA).section("k8s")  # documented
    k = s.section("k8s")
    assert (k.condition_prefix, k.condition_severity, k.heartbeat, k.events_namespace) == ("Robustd", Severity.WARNING,
                                                                                           300.0, "default")
    assert k.quarantine.actions == [] and k.quarantine.release_after == 300.0 and k.quarantine.max_fraction == 0.1
    s = load_config(write(tmp_path, "k8s:\n  quarantine:\n    actions: [reboot, HW_INSPECT]\n"), SCHEMA)
    assert s.section("k8s").quarantine.actions == [Action.REBOOT, Action.HW_INSPECT]
    bad = {"k8s:\n  heartbeat: 1s\n": ("k8s.heartbeat", ":2:", "at least 10s"),
           "node_name: x\nk8s:\n  quarantine:\n    actions: [REBOOOT]\n": ("k8s.quarantine.actions", ":4:",
                                                                          "unknown action"),
           "k8s:\n  condition_prefix: robustd\n": ("k8s.condition_prefix", ":2:", ""),
           "k8s:\n  node_name: Not_A_Node\n": ("k8s.node_name", ":2:", ""),
           "k8s:\n  taint: x\n": ("k8s.taint", ":2:", "")}
    for text, (key, line, why) in bad.items():
        with pytest.raises(ConfigError) as e:
            load_config(write(tmp_path, text), SCHEMA)
        msg = str(e.value)
        assert key in msg and line in msg and why in msg, msg


def test_a_bad_config_exits_78_and_its_unit_does_not_restart_on_it(tmp_path: Path) -> None:
    """EX_CONFIG with and without --check-config, key and line told; the unit's RestartPreventExitStatus=78 stops
    the restart every 5 s forever, and no ExecStartPre= can fail first (systemd applies RestartPreventExitStatus=
    to the main process only, so a failing ExecStartPre= would be restarted all the same)."""
    cfg = write(tmp_path, "# robustd\nk8s:\n  heartbeat: 1s\n")
    run = [sys.executable, "-m", "robustd.adapters.k8s.agent", "--config", cfg]
    for extra in ([], ["--check-config"]):
        p = subprocess.run([*run, *extra], capture_output=True, text=True, timeout=60, cwd=REPO,
                           stdin=subprocess.DEVNULL)
        assert p.returncode == 78, (extra, p.returncode, p.stderr)
        assert f"{cfg}:3: k8s.heartbeat: " in p.stderr and "Traceback" not in p.stderr, p.stderr
    unit = (REPO / "systemd" / "robustd-k8s.service").read_text().splitlines()
    assert "RestartPreventExitStatus=78" in unit and "Restart=on-failure" in unit
    assert not [line for line in unit if line.startswith("ExecStartPre=") and not line.startswith("ExecStartPre=-")]
    assert any(line.startswith("ExecStart=/usr/bin/robustd-k8s --config ") for line in unit)
