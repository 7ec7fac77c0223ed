"""The Node as robustd wants it, re-applied until the API server agrees.

One `step()` at a time (the agent calls it every turn; a test calls it with a simulated clock):
  1. read the Node once at start: robustd's conditions already on it (their lastTransitionTime is kept
     across agent restarts) and a quarantine robustd holds (recognised by its annotation);
  2. conditions: a strategic merge patch of `status.conditions` (merge key `type`, so Kubernetes' own
     conditions are untouched) when one of them changed, and a heartbeat every `k8s.heartbeat` plus up
     to 10% jitter, so a quiet node writes about 3600/heartbeat times an hour;
  3. Events still to post, oldest first; the same event again within an hour counts the existing Event
     object up (count, lastTimestamp) as kubelet does, and a name taken by an earlier run means posted;
  4. quarantine (opt-in): cordon + taint + ownership annotations by read-modify-write carrying the node's
     resourceVersion, retried on 409; released after `quarantine.release_after` of OK, undoing only
     what robustd did (a cordon someone else made stays); a fault whose news is older than
     `k8s.max_event_age` cordons nothing (it is logged as stale).
Each write is a decision (`decide`): logged in act's words, counted in the state file. In shadow mode
(`k8s.mode: shadow`) every rule runs the same, reads included, but nothing is written: the decision is
logged as "would ..." and counted, and what it would have written is taken as written, so the next
decisions are the ones act would make.
A failure leaves the desired state where it is: the whole step is retried after a capped exponential
backoff with jitter (or the server's Retry-After), so nothing is lost while the API server is away.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Callable

from robustd.adapters.common.model import Cond, Table
from robustd.adapters.k8s import families
from robustd.adapters.k8s import kube as k8s_api
from robustd.adapters.k8s.config import K8sConfig
from robustd.adapters.k8s.families import EventSpec, NodeCondition
from robustd.adapters.k8s.kube import AlreadyExists, Conflict, Kube, KubeError, NotFound, Refused, Transient
from robustd.adapters.k8s.state import (
    MAX_PENDING,
    MAX_RECENT,
    MAX_SERIES,
    Decision,
    K8sState,
    K8sStateFile,
    Quarantine,
    Series,
)

log = logging.getLogger("robustd.k8s")

TAINT_KEY = "robustd.io/unhealthy"
CORDONED_BY = "robustd.io/cordoned-by"
PRE_EXISTING = "robustd.io/pre-existing-cordon"
EVIDENCE = "robustd.io/evidence"  # the id of the bundle robustd made for the cordon (robustctl evidence show ID)
OWNER = "robustd"
COMPONENT = "robustd"
SERIES_WINDOW = 3600.0  # an identical event within this counts up the existing Event object
BACKOFF_BASE = 0.5
JITTER = 0.1  # heartbeats come every heartbeat x [1, 1.1]
PUT_ATTEMPTS = 5  # read-modify-PUT rounds lost to 409 before the step is retried with backoff
BREAKER_RECHECK = 60.0  # a suppressed quarantine is looked at again this often


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def news_key(c: Cond) -> str:
    """A condition's key in K8sState.seen."""
    return f"{c.component}|{c.code}"


def quarantined_by_robustd(meta: dict[str, Any]) -> bool:
    """Whether a node's metadata says robustd holds its quarantine (the annotation its cordon writes with the
    taint, and its release removes with it): what the breaker counts from a metadata-only list."""
    return ((meta.get("annotations") or {}).get(CORDONED_BY)) == OWNER


@dataclass(eq=False)
class Reconciler:
    """Moves one Node toward robustd's table: its Robustd* conditions, Events and quarantine, with backoff."""

    cfg: K8sConfig
    kube: Kube
    node: str
    state_file: K8sStateFile
    state: K8sState
    clock: Callable[[], float] = time.time
    rng: random.Random = field(default_factory=random.Random)
    # (component, code, reason) -> the id of an evidence bundle robustd made for this cordon, or None (no socket,
    # or robustd made none in time: client.evidence logs why; the cordon goes on without it).
    evidence: Callable[[str, str, str], str | None] | None = None
    applied: dict[str, dict[str, Any]] | None = field(default=None, init=False)  # robustd's on the Node, by type
    next_heartbeat: float = field(default=0.0, init=False)
    retry_at: float = field(default=0.0, init=False)
    failures: int = field(default=0, init=False)
    breaker_at: float = field(default=0.0, init=False)
    last_error: str = field(default="", init=False)
    writes: int = field(default=0, init=False)  # condition patches made (the benchmark's figure)

    @property
    def shadow(self) -> bool:
        return self.cfg.mode == "shadow"

    def decide(self, kind: str, text: str) -> None:
        """One decision: logged (shadow: "would " + act's words), counted in the state file."""
        mode = self.cfg.mode
        d = Decision(at=self.clock(), mode=mode, kind=kind, text=text)
        kinds = self.state.decisions.setdefault(mode, {})
        kinds[kind] = kinds.get(kind, 0) + 1
        self.state.recent.append(d)
        del self.state.recent[:-MAX_RECENT]
        level = logging.WARNING if kind in ("cordon", "stale") else logging.INFO
        log.log(level, "%s", d.words)

    def reconfigure(self, cfg: K8sConfig) -> None:
        """A reload's `k8s:` section. From shadow to act nothing decided before the switch is carried out:
        the Node is read again (its real conditions, not the ones shadow took as written), Events queued
        in shadow are dropped, and a quarantine decided in shadow stays a decision with nothing to undo."""
        was = self.cfg.mode
        self.cfg = cfg
        self.breaker_at = 0.0
        if was == cfg.mode:
            return
        if was == "shadow":
            if self.state.pending:
                log.info("%d Events decided in shadow mode are not posted", len(self.state.pending))
                self.state.events_seq = max([self.state.events_seq, *(e.seq for e in self.state.pending)])
                self.state.pending.clear()
            self.applied = None
        self.next_heartbeat = 0.0
        log.warning("k8s.mode is now %s: %s", cfg.mode, "decisions from now on are carried out" if cfg.mode == "act"
                    else "nothing is written to the API server from now on")
        self.save()

    # --- the step -----------------------------------------------------------------------------------

    def step(self, table: Table | None, down_why: str | None = None) -> float:
        """Bring the Node toward what `table` says (or Unknown when `down_why`); seconds until due again."""
        now = self.clock()
        if now < self.retry_at:
            return self.retry_at - now
        try:
            if self.applied is None:
                self._load()
            if down_why is not None:
                self._conditions(families.unknown(self.cfg, down_why), now)
            elif table is not None:
                conds = list(table.conditions.values())
                self._conditions(families.desired(conds, self.cfg), now)
            self._events(now)
            if table is not None and down_why is None:
                self._quarantine(table, now)
        except KubeError as e:
            return self._failed(e, now)
        except (KeyError, TypeError, AttributeError, ValueError) as e:  # an answer not shaped like a Node
            return self._failed(Refused(f"node {self.node}: unexpected answer from the API server: "
                                        f"{type(e).__name__}: {e}"), now)
        self.failures = 0
        if self.last_error:
            log.info("the API server answers again")
            self.last_error = ""
        due = [self.next_heartbeat] if self.applied is not None else []
        if self.state.quarantine is not None and self.state.ok_since is not None:
            due.append(self.state.ok_since + self.cfg.quarantine.release_after)
        if self.state.pending:
            due.append(now)
        return max(0.0, min(due, default=now + 60.0) - now)

    def _failed(self, e: KubeError, now: float) -> float:
        self.failures += 1
        delay = min(self.cfg.max_backoff, BACKOFF_BASE * 2 ** min(self.failures - 1, 30))
        delay *= 0.5 + self.rng.random() / 2  # full jitter's gentler cousin: 50-100% of the backoff
        if isinstance(e, (Refused, NotFound)):
            delay = self.cfg.max_backoff  # a refusal is not fixed by hammering
        if e.retry_after is not None:
            delay = max(delay, min(e.retry_after, self.cfg.max_backoff))
        self.retry_at = now + delay
        text = str(e)
        if isinstance(e, (Refused, NotFound)):
            text += " (robustd-k8s's own failure, not a hardware verdict: check the node name, kubeconfig and RBAC)"
        if text != self.last_error:
            log.log(logging.WARNING if isinstance(e, Transient) else logging.ERROR, "%s; retrying in %.1fs",
                    text, delay)
            self.last_error = text
        return delay

    # --- read at start ------------------------------------------------------------------------------

    def _load(self) -> None:
        node = self.kube.get_node(self.node)
        prefix = self.cfg.condition_prefix
        self.applied = {c["type"]: c for c in (node.get("status") or {}).get("conditions") or []
                        if isinstance(c, dict) and str(c.get("type", "")).startswith(prefix)}
        ann = (node.get("metadata") or {}).get("annotations") or {}
        if self.state.quarantine is None and ann.get(CORDONED_BY) == OWNER:
            value = next((t.get("value", "") for t in (node.get("spec") or {}).get("taints") or []
                          if t.get("key") == TAINT_KEY), "")
            self.state.quarantine = Quarantine(action=str(value), fault="(adopted from the node's annotations)",
                                               since=self.clock(), pre_existing_cordon=ann.get(PRE_EXISTING) == "true")
            log.info("node %s carries robustd's quarantine (annotation %s): adopted", self.node, CORDONED_BY)

    # --- conditions ---------------------------------------------------------------------------------

    def _conditions(self, want: list[NodeCondition], now: float) -> None:
        assert self.applied is not None
        changed = [w for w in want if self._differs(w)]
        if not changed and now < self.next_heartbeat:
            return
        stamp = rfc3339(now)
        body = []
        for w in want:
            old = self.applied.get(w.type)
            moved = old is None or old.get("status") != w.status or not old.get("lastTransitionTime")
            body.append({"type": w.type, "status": w.status, "reason": w.reason, "message": w.message,
                         "lastHeartbeatTime": stamp,
                         "lastTransitionTime": stamp if moved else old["lastTransitionTime"]})
        if self.shadow:  # taken as written, so the next change is decided against it, as act would
            self.applied.update({b["type"]: b for b in body})
        else:
            node = self.kube.patch_node_status(self.node, {"status": {"conditions": body}})
            self.writes += 1
            prefix = self.cfg.condition_prefix
            self.applied = {c["type"]: c for c in (node.get("status") or {}).get("conditions") or []
                            if isinstance(c, dict) and str(c.get("type", "")).startswith(prefix)}
        self.next_heartbeat = now + self.cfg.heartbeat * (1 + JITTER * self.rng.random())
        for w in changed:
            self.decide("condition", f"set condition {w.type}={w.status} on {self.node} ({w.reason}) {w.message}")

    def _differs(self, w: NodeCondition) -> bool:
        assert self.applied is not None
        old = self.applied.get(w.type)
        return old is None or (old.get("status"), old.get("reason"), old.get("message")) != (w.status, w.reason,
                                                                                              w.message)

    # --- events -------------------------------------------------------------------------------------

    def queue(self, spec: EventSpec) -> None:
        """An Event to post (bounded: the oldest go first when the API server has been away for long)."""
        self.state.pending.append(spec)
        if len(self.state.pending) > MAX_PENDING:
            dropped = self.state.pending[: len(self.state.pending) - MAX_PENDING]
            del self.state.pending[: len(dropped)]
            log.error("%d Events could not be posted and were dropped (the API server has been unreachable for "
                      "long); the node conditions still say what stands", len(dropped))

    def _events(self, now: float) -> None:
        while self.state.pending:
            spec = self.state.pending[0]
            if not self.shadow:
                self._post(spec, now)
            self.decide("event", f"post event {spec.type} {spec.reason} on {self.node}: {spec.message}")
            self.state.pending.pop(0)
            self.state.events_seq = max(self.state.events_seq, spec.seq)
            self.save()

    def _post(self, spec: EventSpec, now: float) -> None:
        ns = self.cfg.events_namespace
        key = f"{spec.type}|{spec.reason}|{spec.message}"
        series = self.state.series.get(key)
        stamp = rfc3339(now)
        if series is not None and now - series.last < SERIES_WINDOW:
            try:
                self.kube.patch_event(ns, series.name, {"count": series.count + 1, "lastTimestamp": stamp})
                series.count += 1
                series.last = now
                self.state.series[key] = self.state.series.pop(key)  # most recent last
                return
            except NotFound:
                pass  # the server let it expire (its event TTL): a new one
        name = f"{self.node}.robustd.{spec.seq:x}.{int(now * 1000):x}" if spec.seq == 0 else \
            f"{self.node}.robustd.{spec.seq:x}" + (f".{spec.tag}" if spec.tag else "")
        event = {"apiVersion": "v1", "kind": "Event",
                 "metadata": {"name": name, "namespace": ns},
                 "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": self.node},
                 "reason": spec.reason, "message": spec.message, "type": spec.type, "count": 1,
                 "firstTimestamp": stamp, "lastTimestamp": stamp,
                 "source": {"component": COMPONENT, "host": self.node},
                 "reportingComponent": COMPONENT, "reportingInstance": self.node}
        try:
            self.kube.create_event(ns, event)
        except AlreadyExists:
            log.info("event %s/%s exists already (posted before a restart)", ns, name)
        self.state.series[key] = Series(name=name, count=1, first=now, last=now)
        while len(self.state.series) > MAX_SERIES:
            self.state.series.pop(next(iter(self.state.series)))

    # --- quarantine ---------------------------------------------------------------------------------

    def _quarantine(self, table: Table, now: float) -> None:
        q = families.quarantine_for(list(table.conditions.values()), self.cfg)
        st = self.state
        if q is not None:
            if st.ok_since is not None:
                st.ok_since = None
                self.save()
            if st.quarantine is None and not self._stale(q, now) and now >= self.breaker_at and \
                    self._breaker_allows(q, now):
                self._cordon(q, now)
            return
        st.suppressed = ""
        st.stale = ""
        if st.quarantine is None:
            return
        if st.ok_since is None:
            st.ok_since = now
            self.save()
        if now - st.ok_since >= self.cfg.quarantine.release_after:
            self._release()

    def _stale(self, q: Cond, now: float) -> bool:
        """Whether the news of `q` is older than k8s.max_event_age (logged once per fault). A condition with
        no recorded time (the reconciler driven without an agent) counts as current."""
        at = self.state.seen.get(news_key(q))
        if at is None or now - at <= self.cfg.max_event_age:
            return False
        fault = f"{q.code} on {q.component}"
        if self.state.stale != fault:
            self.decide("stale", f"ignore stale news for {self.node}: {fault} was read {now - at:.0f}s after it "
                        f"happened ({rfc3339(at)}), older than k8s.max_event_age {self.cfg.max_event_age:g}s: "
                        "no cordon")
            self.state.stale = fault
            self.save()
        return True

    def _breaker_allows(self, q: Cond, now: float) -> bool:
        nodes = self.kube.list_node_metadata(self.cfg.quarantine.node_selector)
        total = len(nodes)
        held = sum(1 for m in nodes if quarantined_by_robustd(m) and m.get("name") != self.node)
        allowance = max(1, math.floor(self.cfg.quarantine.max_fraction * total))
        if held < allowance:
            return True
        self.breaker_at = now + BREAKER_RECHECK
        fault = f"{q.code} on {q.component}"
        if self.state.suppressed != fault:
            text = (f"not quarantining for {fault} (action {q.action.name}): {held} of {total} nodes are already "
                    f"quarantined by robustd ({TAINT_KEY}) (allowance {allowance}, k8s.quarantine.max_fraction "
                    f"{self.cfg.quarantine.max_fraction:g})")
            log.warning("node %s: %s", self.node, text)
            self.queue(EventSpec(0, "Warning", "QuarantineSuppressed", families._clip(text)))
            self.state.suppressed = fault
            self.save()
        return False

    def _read_modify_put(self, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
        """GET, compute the change, write it with the resourceVersion read; a 409 (someone wrote in between)
        starts over from a fresh read, so neither their write nor ours is lost. Shadow: the read and the
        change, no write."""
        for _ in range(PUT_ATTEMPTS):
            node = self.kube.get_node(self.node)
            patch = change(node)
            if patch is None or self.shadow:
                return
            try:
                self.kube.patch_node_if_unchanged(self.node, patch, str(node["metadata"]["resourceVersion"]))
                return
            except Conflict:
                log.info("node %s changed under robustd-k8s's update (409): reading it again", self.node)
        raise Transient(f"update node {self.node}: {PUT_ATTEMPTS} conflicts in a row")

    def _cordon(self, q: Cond, now: float) -> None:
        effect = self.cfg.quarantine.taint_effect
        pre: list[bool] = []
        fault = f"{q.code} on {q.component}"
        # Asked before the write, only when it will be written: `kubectl describe node` leads to the bundle.
        ident = self.evidence(q.component, q.code, f"cordon {self.node}: {fault}") \
            if self.evidence is not None and not self.shadow else None

        def change(node: dict[str, Any]) -> dict[str, Any] | None:
            spec = node.get("spec") or {}
            ann = (node.get("metadata") or {}).get("annotations") or {}
            ours = ann.get(CORDONED_BY) == OWNER
            pre[:] = [ann.get(PRE_EXISTING) == "true" if ours else bool(spec.get("unschedulable"))]
            taints = [t for t in spec.get("taints") or [] if t.get("key") != TAINT_KEY]
            taints.append({"key": TAINT_KEY, "value": q.action.name, "effect": effect})
            annotations = {CORDONED_BY: OWNER, PRE_EXISTING: "true" if pre[0] else "false", EVIDENCE: ident}
            return {"spec": {"taints": taints, "unschedulable": True}, "metadata": {"annotations": annotations}}

        self._read_modify_put(change)
        self.state.quarantine = Quarantine(action=q.action.name, fault=fault, since=now,
                                           pre_existing_cordon=bool(pre and pre[0]), shadow=self.shadow)
        words = (f"cordon {self.node}: {fault} (CRITICAL, action {q.action.name}), taint "
                 f"{TAINT_KEY}={q.action.name}:{effect}" + (" (it was cordoned already: that cordon stays)"
                                                             if pre and pre[0] else ""))
        self.decide("cordon", words + (f", evidence {ident}" if ident else ""))
        self.queue(EventSpec(0, "Warning", "RobustdCordoned", families._clip(  # shadow: decided, not posted
            f"cordoned by robustd-k8s: {fault} (CRITICAL, action {q.action.name})"
            + (f"; evidence {ident} (robustctl evidence show {ident})" if ident else "; no evidence bundle"))))
        self.save()

    def _release(self) -> None:
        held = self.state.quarantine
        assert held is not None
        kept: list[str] = []  # why the cordon stays, when it does

        def change(node: dict[str, Any]) -> dict[str, Any] | None:
            spec = node.get("spec") or {}
            ann = (node.get("metadata") or {}).get("annotations") or {}
            taints = list(spec.get("taints") or [])
            kept_taints = [t for t in taints if t.get("key") != TAINT_KEY]
            patch: dict[str, Any] = {}
            if kept_taints != taints:
                patch.setdefault("spec", {})["taints"] = kept_taints or None
            pre = held.pre_existing_cordon or ann.get(PRE_EXISTING) == "true"
            # The cordon is robustd's to undo only while spec.unschedulable is still robustd-k8s's in the
            # managed fields: someone who cordoned the node again since (`kubectl cordon` after an uncordon) keeps
            # it. A server keeping no managed fields leaves the annotations to tell.
            owners = k8s_api.field_owners(node, "spec", "unschedulable")
            kept.clear()
            if pre:
                kept.append("someone else cordoned it first")
            elif ann.get(CORDONED_BY) == OWNER and spec.get("unschedulable"):
                if owners and k8s_api.FIELD_MANAGER not in owners:
                    kept.append(f"spec.unschedulable is {', '.join(owners)}'s now, not {k8s_api.FIELD_MANAGER}'s: "
                                "cordoned again after robustd did")
                else:
                    patch.setdefault("spec", {})["unschedulable"] = None
            drop = {k: None for k in (CORDONED_BY, PRE_EXISTING, EVIDENCE) if k in ann}
            if drop:
                patch["metadata"] = {"annotations": drop}
            return patch or None

        if held.shadow and not self.shadow:  # decided before the switch to act: nothing on the Node to undo
            log.info("node %s: the quarantine decided in shadow mode ends (nothing on the Node to undo)", self.node)
        else:
            self._read_modify_put(change)
            self.decide("uncordon", f"uncordon {self.node}: robustd's verdict has been OK for "
                        f"{self.cfg.quarantine.release_after:g}s" + (f" (only the taint: {kept[0]})" if kept else ""))
        self.state.quarantine = None
        self.state.ok_since = None
        self.save()

    # --- state --------------------------------------------------------------------------------------

    def save(self) -> None:
        try:
            self.state_file.write(self.state)  # type: ignore[arg-type]
        except OSError as e:
            log.error("cannot save the state file %s: %s", self.state_file.path, e)
