"""Bounds on a run request (design rule 7): every field from outside has a size or a range.

An impossible rendezvous must not reach a child: a world_size of 2**32-1 grew one until the OOM
killer came, and a port past 65535 made all_gather blame node rank 0 for the request's mistake.
"""

from __future__ import annotations

import re

from robustd.config import DiagnosticsConfig
from robustd.diagnostics.model import RunRequest

MAX_RUN_TIMEOUT = 7 * 86400.0
MAX_NAME = 64  # a level or test name
MAX_TESTS = 16
MAX_GPUS = 1024
MAX_BUS_ID = 64
MAX_FAULTS_JSON = 64 << 10
MAX_ADDR = 253  # the longest DNS name
ADDR = re.compile(r"[A-Za-z0-9._:%-]+")  # a host name, an IPv4 or an IPv6 address (with a %zone)
RUN_ID = re.compile(r"[A-Za-z0-9._:/@+=-]{0,128}")  # the scheduler's job or step id


class BadRequest(Exception):
    """An invalid run request (→ INVALID_ARGUMENT)."""


def validate(req: RunRequest, cfg: DiagnosticsConfig) -> None:
    """Refuse (BadRequest) what no test could use, before anything starts."""
    if len(req.level) > MAX_NAME:
        raise BadRequest(f"level is longer than {MAX_NAME} characters")
    if len(req.tests) > MAX_TESTS or any(len(t) > MAX_NAME for t in req.tests):
        raise BadRequest(f"tests: at most {MAX_TESTS} names of at most {MAX_NAME} characters")
    if len(req.gpus) > MAX_GPUS or any(not g or len(g) > MAX_BUS_ID for g in req.gpus):
        raise BadRequest(f"gpus: at most {MAX_GPUS} bus ids of 1 to {MAX_BUS_ID} characters")
    if len(req.test_faults_json) > MAX_FAULTS_JSON:
        raise BadRequest(f"test_faults_json is longer than {MAX_FAULTS_JSON} bytes")
    if req.timeout is not None and not 0 < req.timeout <= MAX_RUN_TIMEOUT:
        raise BadRequest(f"timeout must be positive and at most {MAX_RUN_TIMEOUT / 86400:g} days")
    if not RUN_ID.fullmatch(req.run_id):
        raise BadRequest("run_id must be at most 128 characters of A-Z a-z 0-9 . _ : / @ + = -")
    rv = req.rendezvous
    if rv is not None:
        if not rv.master_addr or len(rv.master_addr) > MAX_ADDR or not ADDR.fullmatch(rv.master_addr):
            raise BadRequest(f"rendezvous.master_addr must be a host name or an IP address of 1 to {MAX_ADDR} "
                             "characters")
        if not 1 <= rv.master_port <= 65535:
            raise BadRequest(f"rendezvous.master_port must be between 1 and 65535, not {rv.master_port}")
        if not 1 <= rv.world_size <= cfg.max_world_size:
            raise BadRequest(f"rendezvous.world_size must be between 1 and {cfg.max_world_size} nodes "
                             f"(diagnostics.max_world_size), not {rv.world_size}")
        if rv.node_rank >= rv.world_size:
            raise BadRequest(f"rendezvous.node_rank must be below world_size {rv.world_size}, not {rv.node_rank}")
        if not RUN_ID.fullmatch(rv.run_id):
            raise BadRequest("rendezvous.run_id must be at most 128 characters of A-Z a-z 0-9 . _ : / @ + = -")
