"""One pass of the decisions against the real Slurm: read the node, decide, check the breaker, act, record.

The agent runs a pass on every fault change, on its timers and at every reconcile; the robustctl
hooks run exactly one. A pass holds the state lock throughout, reads the state file afresh, and
reads the node from slurmctld right before acting, so neither the agent nor a hook acts on a stale
picture. A Slurm call that fails (slurmctld down, a timeout) changes nothing in Slurm and is
retried by the next pass; what was observed is still recorded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from robustd.adapters.common import client
from robustd.adapters.common.model import Table
from robustd.adapters.slurm.config import SlurmConfig
from robustd.adapters.slurm.decide import (
    REASON_MAX,
    Do,
    Health,
    Plan,
    applied,
    breaker,
    decide,
    diagnosis_plan,
    fault_text,
    self_checked,
    suppressed,
)
from robustd.adapters.slurm.model import AgentState, AgentStateFile, NodeView, SelfCheck, Shadow, Suppression
from robustd.adapters.slurm.slurmcli import Slurm, SlurmError

log = logging.getLogger("robustd.slurm")


@dataclass(frozen=True)
class Result:
    plan: Plan
    node: NodeView | None = None  # Slurm's view before the action
    error: str = ""  # the Slurm action failed: nothing changed there, try again later
    suppressed: Suppression | None = None  # the breaker refused the drain
    state: AgentState | None = None  # the state as saved
    shadow: bool = False  # slurm.mode shadow: the plan was logged and counted as a would-decision, not carried out

    @property
    def acted(self) -> bool:
        return (not self.shadow and not self.error and self.suppressed is None
                and self.plan.do in (Do.DRAIN, Do.RESUME, Do.SET_REASON))


WOULD = {"drain": "would drain", "down": "would down", "reboot": "would reboot"}  # act's log: drained, downed, ...


def shadow_view(node: NodeView, st: AgentState) -> NodeView:
    """Slurm's real node with the shadow's would-be drain laid over it, so that the rules see what they would
    have seen had they acted (held by us, then the hold-down, then a resume). A node really out of service
    (someone else's drain, or robustd's own from act mode) is shown as it is."""
    d = st.drain
    if d is None or node.out_of_service:
        return node
    flags = set(node.flags) | {"DRAIN"}
    if d.mode == "reboot":
        flags.add("REBOOT_REQUESTED")
    return replace(node, state="DOWN" if d.mode == "down" else node.state, flags=frozenset(flags), reason=d.reason)


@dataclass(eq=False)
class Actor:
    """Applies the Slurm decisions to one node, a step at a time, under the state file's lock."""

    cfg: SlurmConfig
    slurm: Slurm
    state_file: AgentStateFile
    node_name: str
    clock: Callable[[], float] = time.time
    lock_timeout: float = 60.0
    socket: str = ""  # robustd's: an evidence bundle is asked for before each drain ("": none)
    evidence_timeout: float = 5.0
    _last_note: str = field(default="", init=False)
    _last_warning: str = field(default="", init=False)

    def step(self, h: Health, table: Table | None = None, stale_events: int | None = None) -> Result:
        """Decide and act once. SlurmError (the node could not be read) and LockTimeout propagate. The agent
        passes its table, and with it the stale news it read (`h.stale`, `stale_events`) to be kept."""
        with self.state_file.locked(self.lock_timeout):
            st = self.state_file.read()
            st.node = self.node_name
            if table is not None:
                st.table = table
            if stale_events is not None:
                st.stale = sorted(h.stale)
                st.stale_events = stale_events
            node = self.slurm.node(self.node_name)
            now = self.clock()
            if self.shadow:
                sh = self._shadow(st)
                node = shadow_view(node, sh.state)
                plan, sh.state = decide(self.cfg, h, node, sh.state, now)
            else:
                plan, st = decide(self.cfg, h, node, st, now)
            self._note(plan.note)
            return self._carry_out(plan, st, h, node, now)

    def record_self_check(self, h: Health, result: SelfCheck, table: Table | None = None) -> Result:
        """Store the resume check's outcome; a FAIL rewrites the reason with the report id (the node stays out)."""
        with self.state_file.locked(self.lock_timeout):
            st = self.state_file.read()
            if table is not None:
                st.table = table
            if self.shadow:
                sh = self._shadow(st)
                plan, sh.state = self_checked(self.cfg, sh.state, result)
            else:
                plan, st = self_checked(self.cfg, st, result)
            self._note(plan.note, level=logging.WARNING if result.outcome != "PASS" else logging.INFO)
            node = self.slurm.node(self.node_name) if plan.do is not Do.NOTHING else None
            if node is not None and self.shadow:
                node = shadow_view(node, self._shadow(st).state)
            return self._carry_out(plan, st, h, node, self.clock())

    def diagnosis(self, h: Health, report_id: str, summary: str, job: str) -> Result:
        """The epilog's diagnostics FAILed: drain with the report id (breaker first), unless already out."""
        with self.state_file.locked(self.lock_timeout):
            st = self.state_file.read()
            st.node = self.node_name
            node = self.slurm.node(self.node_name)
            if self.shadow:
                node = shadow_view(node, self._shadow(st).state)
            plan = diagnosis_plan(self.cfg, node, report_id, summary, job)
            self._note(plan.note, level=logging.WARNING)
            return self._carry_out(plan, st, h, node, self.clock())

    def save_table(self, table: Table) -> None:
        with self.state_file.locked(self.lock_timeout):
            st = self.state_file.read()
            st.node = st.node or self.node_name
            st.table = table
            self.state_file.write(st)

    @property
    def shadow(self) -> bool:
        return self.cfg.mode == "shadow"

    def _shadow(self, st: AgentState) -> Shadow:
        if st.shadow is None:
            st.shadow = Shadow(state=AgentState(node=self.node_name))
        return st.shadow

    def _carry_out(self, plan: Plan, st: AgentState, h: Health, node: NodeView | None, now: float) -> Result:
        if self.shadow:
            sh = self._shadow(st)
            result = self._would(plan, sh, h, node, now)
            sh.state = result.state or sh.state
            result = replace(result, state=st)
            sup = sh.state.suppressed
        else:
            result = self._act(plan, st, h, node, now)
            st = result.state or st
            sup = st.suppressed
        if sup is None and self._last_warning:
            log.info("SLURM_DRAIN_SUPPRESSED cleared")
            self._last_warning = ""
        self.state_file.write(st)
        return result

    def _would(self, plan: Plan, sh: Shadow, h: Health, node: NodeView | None, now: float) -> Result:
        """slurm.mode shadow: `_act` up to the write, Slurm read as in act (the node, the breaker's partition
        rows, the re-read right before a drain), and in place of the scontrol update the decision logged in act's
        words prefixed "would" and counted; the shadow's state moves on as if it had been carried out."""
        name = self.node_name
        st = sh.state
        try:
            if plan.do is Do.DRAIN and node is not None:
                held = self._before_drain(plan, st, h, node, now, shadow=True)
                if held is not None:
                    return held
                kind, text = plan.mode, f"{WOULD[plan.mode]} {name}: {plan.reason}"
            elif plan.do is Do.RESUME and node is not None:
                kind, text = "resume", f"would resume {name}"
            elif plan.do is Do.SET_REASON:
                kind, text = "set_reason", f"would keep {name} drained: {plan.reason}"
            else:
                return Result(plan, node, state=st, shadow=True)
        except SlurmError as e:
            log.error("shadow: %s %s: reading Slurm failed (%s); will try again", plan.do.value, name, e)
            return Result(plan, node, error=str(e), state=st, shadow=True)
        log.warning("%s", text)
        sh.record(kind, text, now)
        return Result(plan, node, state=applied(plan, st, h, now), shadow=True)

    def _before_drain(self, plan: Plan, st: AgentState, h: Health, node: NodeView, now: float,
                      shadow: bool) -> Result | None:
        """What keeps a drain from happening, in act and shadow alike: the breaker (on the partitions' rows),
        or someone else taking the node out meanwhile (read again right before writing: never overwrite a
        reason set meanwhile). None: go on and drain."""
        name = self.node_name
        rows = self.slurm.partition_rows(node.partitions)
        sup = breaker(self.cfg, node, rows, fault_text(h) if h.bad else plan.reason, now)
        if sup is not None:
            self._warn(f"shadow: {sup.text()}; {name} would stay in service" if shadow
                       else f"{sup.text()}; {name} stays in service")
            return Result(plan, node, suppressed=sup, state=suppressed(st, sup), shadow=shadow)
        fresh = self.slurm.node(name)
        if fresh.out_of_service:
            self._note(f"{name} was taken out by someone else meanwhile ({fresh.describe()}); "
                       + ("would not drain" if shadow else "not draining"))
            return Result(Plan(Do.NOTHING), fresh, state=st, shadow=shadow)
        return None

    def _act(self, plan: Plan, st: AgentState, h: Health, node: NodeView | None, now: float) -> Result:
        name = self.node_name
        try:
            if plan.do is Do.DRAIN and node is not None:
                held = self._before_drain(plan, st, h, node, now, shadow=False)
                if held is not None:
                    return held
                plan = replace(plan, reason=self._with_evidence(plan.reason, h))
                {"drain": self.slurm.drain, "down": self.slurm.down,
                 "reboot": self.slurm.reboot}[plan.mode](name, plan.reason)
                log.warning("%s %s: %s", {"drain": "drained", "down": "downed", "reboot": "reboot requested for"}
                            [plan.mode], name, plan.reason)
            elif plan.do is Do.RESUME and node is not None:
                if plan.cancel_reboot:
                    self.slurm.cancel_reboot(name)
                self.slurm.resume(name)
                log.warning("resumed %s (was: %s)", name, node.reason)
            elif plan.do is Do.SET_REASON:
                self.slurm.drain(name, plan.reason)
                log.warning("%s stays drained: %s", name, plan.reason)
        except SlurmError as e:
            log.error("%s %s failed (%s); will try again", plan.do.value, name, e)
            return Result(plan, node, error=str(e), state=st)
        if plan.do in (Do.DRAIN, Do.RESUME, Do.SET_REASON):
            st = applied(plan, st, h, now)
        return Result(plan, node, state=st)

    def _with_evidence(self, reason: str, h: Health) -> str:
        """`reason` with ` ev=<id>` of a bundle robustd made for this drain, cut to fit REASON_MAX; as it is
        when robustd made none in time (client.evidence logs why)."""
        ident = client.evidence(self.socket, [c.component for c in h.faults], [c.code for c in h.faults], reason,
                                self.evidence_timeout) if self.socket else None
        if not ident:
            return reason
        tail = f" ev={ident}"
        return (reason if len(reason) + len(tail) <= REASON_MAX else reason[:REASON_MAX - len(tail) - 3] + "...") + tail

    def _note(self, text: str, level: int = logging.INFO) -> None:
        if text and text != self._last_note:
            log.log(level, "%s", text)
        if text:
            self._last_note = text

    def _warn(self, text: str) -> None:
        if text != self._last_warning:
            log.warning("%s", text)
            self._last_warning = text
