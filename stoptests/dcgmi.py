"""The JSON of `dcgmi diag -j` (DCGM 3.x and 4.x), judged: one result per GPU (`gpu/<bus_id>`) plus `host`.

Pure functions of dcgmi's stdout and the spec's GPU list: no process is run here (stoptests/eud.py
runs dcgmi and hands its output to `parse_dcgmi_json`). Standard library only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from stoptests.protocol import ERROR, FAIL, PASS, SKIPPED, Result

ROOT4 = "DCGM Diagnostic"
ROOT3 = "DCGM GPU Diagnostic"
EUD_TESTS = ("eud", "cpu_eud")

# dcgmErrorSeverity_t
SEVERITY_NAMES = {1: "MONITOR", 2: "ISOLATE", 3: "UNKNOWN", 4: "TRIAGE", 5: "CONFIG", 6: "RESET"}
SEV_ISOLATE = 2
SEV_RESET = 6
# dcgmErrorCategory_t
CATEGORY_NAMES = {0: "NONE", 1: "PERF_THRESHOLD", 2: "PERF_VIOLATION", 3: "SOFTWARE_CONFIG", 4: "SOFTWARE_LIBRARY",
                  5: "SOFTWARE_XID", 6: "SOFTWARE_CUDA", 7: "SOFTWARE_EUD", 8: "SOFTWARE_OTHER", 9: "HARDWARE_THERMAL",
                  10: "HARDWARE_MEMORY", 11: "HARDWARE_NVLINK", 12: "HARDWARE_NVSWITCH", 13: "HARDWARE_PCIE",
                  14: "HARDWARE_POWER", 15: "HARDWARE_OTHER", 16: "INTERNAL"}
# The DCGM_FR_* codes named in messages; others are reported by number only.
ERROR_NAMES = {80: "ROW_REMAP_FAILURE", 81: "UNCONTAINED_ERROR", 83: "DBE_PENDING_PAGE_RETIREMENTS",
               84: "UNCORRECTABLE_ROW_REMAP", 85: "PENDING_ROW_REMAP", 86: "BROKEN_P2P_MEMORY_DEVICE",
               87: "BROKEN_P2P_WRITER_DEVICE", 89: "EUD_BINARY_PERMISSIONS", 90: "EUD_NON_ROOT_USER",
               91: "EUD_SPAWN_FAILURE", 92: "EUD_TIMEOUT", 93: "EUD_ZOMBIE", 94: "EUD_NON_ZERO_EXIT_CODE",
               95: "EUD_TEST_FAILED", 101: "XID_ERROR", 120: "FALLEN_OFF_BUS", 131: "CONTAINED_ERROR"}
# 3.x display names that do not reduce to the 4.x canonical name by lower-casing.
_DISPLAY_NAMES = {"eud_test": "eud", "cpu_eud_test": "cpu_eud", "gpu_memory": "memory", "sm_stress": "sm_stress",
                  "memtest": "memtest", "pulse_test": "pulse_test"}
_EUD_MISSING = re.compile(r"not (found|installed|supported|available)|invalid|unknown|no such|not a valid", re.I)


class DcgmiOutputError(ValueError):
    """The text holds no dcgmi diag JSON document this parser understands."""


@dataclass
class _Finding:
    test: str
    status: str  # pass | fail | skip
    errors: list[dict[str, Any]] = field(default_factory=list)
    info: list[str] = field(default_factory=list)
    iteration: int | None = None


@dataclass
class _Component:
    name: str
    label: str
    serial: str | None = None
    findings: list[_Finding] = field(default_factory=list)


# ---------------------------------------------------------------- parsing


def extract_json(text: str) -> Any:
    """The first JSON object in `text` (dcgmi may print a banner first), or None."""
    text = text.strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        pass
    decoder = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        try:
            obj, _ = decoder.raw_decode(text, m.start())
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def canonical_test(name: str) -> str:
    """4.x canonical test names; 3.x display names ("EUD Test", "GPU Memory") mapped onto them."""
    key = re.sub(r"[\s\-]+", "_", str(name).strip().lower())
    return _DISPLAY_NAMES.get(key, key)


def _status(value: Any) -> str:
    s = str(value or "").strip().lower()
    if s in ("pass", "passed", "success"):
        return "pass"
    if s in ("fail", "failed", "warn", "warning", "error"):
        return "fail"
    return "skip"


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _errors(value: Any, test: str) -> list[dict[str, Any]]:
    out = []
    for item in _as_list(value):
        if isinstance(item, dict):
            # 4.x and 3.x use "warning"; DCGM 3.3.9 put the message under "warnings".
            msg = item.get("warning", item.get("warnings", item.get("error", item.get("message", ""))))
            if isinstance(msg, list):
                msg = "; ".join(str(m) for m in msg)
            error_id = _int(item.get("error_id"))
            out.append({"test": test, "error_id": error_id, "name": ERROR_NAMES.get(error_id) if error_id else None,
                        "category": _int(item.get("error_category")), "severity": _int(item.get("error_severity")),
                        "message": str(msg)})
        elif item not in (None, ""):
            out.append({"test": test, "error_id": None, "name": None, "category": None, "severity": None,
                        "message": str(item)})
    return out


def _info(value: Any) -> list[str]:
    return [str(i) for i in _as_list(value) if i not in (None, "")]


def _root(doc: dict[str, Any]) -> tuple[dict[str, Any], str]:
    for key, layout in ((ROOT4, "4"), (ROOT3, "3")):
        if isinstance(doc.get(key), dict):
            return doc[key], layout
    if "test_categories" in doc or "runtime_error" in doc:
        return doc, "4"
    raise DcgmiOutputError(f"no {ROOT4!r} or {ROOT3!r} object in the dcgmi output (keys: {sorted(doc)[:8]})")


def _entity(result: dict[str, Any]) -> tuple[str, int | None]:
    if "gpu_id" in result:  # 3.x: a string
        return "GPU", _int(result.get("gpu_id"))
    group = result.get("entity_group")
    eid = _int(result.get("entity_id"))
    if group is None and result.get("entity_group_id") == 1:
        group = "GPU"
    if group is None and eid is None:
        return "host", None
    return str(group or "entity").upper(), eid


def _serials(doc: dict[str, Any], root: dict[str, Any]) -> dict[int, str]:
    serials: dict[int, str] = {}
    for where in (doc, root):
        for group in _as_list(where.get("entity_groups")):
            if not isinstance(group, dict) or str(group.get("entity_group", "")).upper() != "GPU":
                continue
            for ent in _as_list(group.get("entities")):
                if isinstance(ent, dict) and _int(ent.get("entity_id")) is not None and ent.get("serial_num"):
                    serials[_int(ent["entity_id"])] = str(ent["serial_num"])  # type: ignore[index]
        s3 = where.get("GPU Device Serials")
        if isinstance(s3, dict):
            serials.update({_int(k): str(v) for k, v in s3.items() if _int(k) is not None})  # type: ignore[misc]
    return serials


def _version(doc: dict[str, Any], root: dict[str, Any]) -> str | None:
    for where in (doc.get("metadata"), root.get("metadata"), root, doc):
        if isinstance(where, dict) and where.get("version"):
            return str(where["version"])
    return None


def gpu_component(gpus: list[dict[str, Any]] | None, gpu_id: int) -> str:
    """DCGM GPU id N → `gpu/<bus_id>` of the spec GPU with index N, else `gpu/index<N>`."""
    for gpu in gpus or []:
        if _int(gpu.get("index")) == gpu_id and gpu.get("bus_id"):
            return f"gpu/{gpu['bus_id']}"
    return f"gpu/index{gpu_id}"


class _Collector:
    def __init__(self, gpus: list[dict[str, Any]] | None) -> None:
        self.gpus = gpus
        self.components: dict[str, _Component] = {}
        self.tests_seen: set[str] = set()
        self.runtime_errors: list[str] = []
        self.serials: dict[int, str] = {}
        self.version: str | None = None

    def component(self, group: str, eid: int | None) -> _Component:
        if group == "GPU" and eid is not None:
            name, label = gpu_component(self.gpus, eid), f"GPU {eid}"
        else:
            name, label = "host", ("host" if eid is None else f"{group} {eid}")
        comp = self.components.get(name)
        if comp is None:
            comp = self.components[name] = _Component(name, label)
        if group == "GPU" and eid is not None and eid in self.serials:
            comp.serial = self.serials[eid]
        return comp

    def add_doc(self, doc: dict[str, Any], iteration: int | None = None) -> None:
        root, _layout = _root(doc)
        self.version = self.version or _version(doc, root)
        self.serials.update(_serials(doc, root))
        if root.get("runtime_error"):
            self.runtime_errors.append(str(root["runtime_error"]))
            return
        for cat in _as_list(root.get("test_categories")):
            for test in _as_list(cat.get("tests") if isinstance(cat, dict) else None):
                if isinstance(test, dict):
                    self.add_test(test, iteration)

    def add_test(self, test: dict[str, Any], iteration: int | None) -> None:
        name = canonical_test(test.get("name", "unknown"))
        entity_errors: set[tuple[Any, str]] = set()
        any_fail = False
        results = [r for r in _as_list(test.get("results")) if isinstance(r, dict)]
        for r in results:
            group, eid = _entity(r)
            status = _status(r.get("status"))
            errors = _errors(r.get("warnings"), name) + _errors(r.get("errors"), name)
            if errors and status == "pass":
                status = "fail"  # an error object never passes, whatever the status string says
            any_fail = any_fail or status == "fail"
            entity_errors.update((e["error_id"], e["message"]) for e in errors)
            self.component(group, eid).findings.append(
                _Finding(name, status, errors, _info(r.get("info")), iteration))
        summary = test.get("test_summary")
        if results or isinstance(summary, dict):
            self.tests_seen.add(name)
        if not isinstance(summary, dict):
            return
        # 4.x: test_summary carries every error of the test; those tied to no entity are global.
        global_errors = [e for e in _errors(summary.get("warnings"), name) + _errors(summary.get("errors"), name)
                         if (e["error_id"], e["message"]) not in entity_errors]
        s_status = _status(summary.get("status"))
        if global_errors or (s_status == "fail" and not any_fail):
            self.component("host", None).findings.append(
                _Finding(name, "fail", global_errors, _info(summary.get("info")), iteration))
        elif not results:
            self.component("host", None).findings.append(
                _Finding(name, s_status, [], _info(summary.get("info")), iteration))


def _describe_error(e: dict[str, Any]) -> str:
    parts = []
    if e["error_id"] is not None:
        parts.append(f"error {e['error_id']}" + (f" {e['name']}" if e["name"] else ""))
    if e["severity"] is not None:
        parts.append(SEVERITY_NAMES.get(e["severity"], f"severity {e['severity']}"))
    head = ", ".join(parts)
    return f"{e['message']} ({head})" if head else e["message"]


def _uniq(values: list[Any]) -> list[Any]:
    return sorted({v for v in values if v is not None})


def _judge(comp: _Component, require_eud: bool, base: dict[str, Any]) -> Result:
    tests_failed: list[str] = []
    tests_passed: list[str] = []
    tests_skipped: list[str] = []
    for f in comp.findings:
        bucket = {"fail": tests_failed, "pass": tests_passed}.get(f.status, tests_skipped)
        if f.test not in bucket:
            bucket.append(f.test)
    tests_passed = [t for t in tests_passed if t not in tests_failed]
    tests_skipped = [t for t in tests_skipped if t not in tests_failed and t not in tests_passed]
    eud = ("fail" if any(t in EUD_TESTS for t in tests_failed) else "pass" if any(t in EUD_TESTS for t in tests_passed)
           else "skip" if any(t in EUD_TESTS for t in tests_skipped) else "not run")
    details: dict[str, Any] = dict(base)
    details.update({"entity": comp.label, "eud": eud, "tests_passed": tests_passed, "tests_skipped": tests_skipped})
    if comp.serial:
        details["serial"] = comp.serial

    if tests_failed:
        fails = [f for f in comp.findings if f.status == "fail"]
        errors = [e for f in fails for e in f.errors]
        severities = _uniq([e["severity"] for e in errors])
        details.update({
            "tests_failed": tests_failed,
            "error_ids": _uniq([e["error_id"] for e in errors]),
            "error_categories": _uniq([e["category"] for e in errors]),
            "error_severities": severities,
            "errors": errors,
            "severity": "CRITICAL" if SEV_ISOLATE in severities or SEV_RESET in severities else "WARNING",
        })
        if SEV_RESET in severities and SEV_ISOLATE not in severities:
            details["action"] = "RESET_GPU"
        iterations = _uniq([f.iteration for f in fails])
        if iterations:
            details["iterations_failed"] = iterations
        texts = []
        for test in tests_failed:
            errs = [_describe_error(e) for e in errors if e["test"] == test]
            its = _uniq([f.iteration for f in fails if f.test == test])
            where = f" in iteration {', '.join(map(str, its))}" if its else ""
            texts.append(f"{test} failed{where}" + (": " + "; ".join(errs) if errs else ""))
        return Result(comp.name, FAIL, f"{comp.label}: " + " | ".join(texts), details=details)

    info = [i for f in comp.findings for i in f.info]
    if require_eud and eud != "pass":
        reason = f"EUD did not run on {comp.label}" + (f": {info[-1]}" if info else " (skipped by dcgmi)")
        return Result(comp.name, SKIPPED, reason, details=details)
    if tests_passed:
        msg = f"{comp.label}: dcgmi diag passed {', '.join(tests_passed)}"
        if eud == "not run":
            msg += " (EUD not run)"
        return Result(comp.name, PASS, msg, details=details)
    reason = f"every dcgmi diag test was skipped on {comp.label}" + (f": {info[-1]}" if info else "")
    return Result(comp.name, SKIPPED, reason, details=details)


def parse_dcgmi_json(text: str, gpus: list[dict[str, Any]] | None = None, require_eud: bool = False) -> list[Result]:
    """Results from the stdout of `dcgmi diag -j` (DCGM 3.x or 4.x, plain, runtime_error or iterations).

    `gpus` is spec["gpus"] (DCGM GPU id N → `gpu/<bus_id>` of the GPU with index N). With `require_eud`
    (the command asked for eud), a GPU on which EUD did not run is SKIPPED rather than PASS, and a document
    without any EUD test gives one SKIPPED result on `host`. Raises DcgmiOutputError when the text holds
    no dcgmi document.
    """
    doc = extract_json(text)
    if not isinstance(doc, dict):
        raise DcgmiOutputError("no JSON object in the dcgmi output")
    col = _Collector(gpus)
    iterations = doc.get("iterations")
    if isinstance(iterations, list):
        for n, it in enumerate(iterations, start=1):
            if isinstance(it, dict):
                col.add_doc(it, n)
    else:
        col.add_doc(doc)
    base: dict[str, Any] = {"dcgm_version": col.version} if col.version else {}
    if isinstance(iterations, list):
        base["iterations"] = len(iterations)

    if col.runtime_errors:
        msg = "; ".join(col.runtime_errors)
        details = dict(base, runtime_error=msg)
        if re.search(r"eud", msg, re.I) and _EUD_MISSING.search(msg):
            return [Result("host", SKIPPED, f"EUD not available: {msg}", details=details)]
        return [Result("host", ERROR, f"dcgmi diag runtime error: {msg}", details=details)]

    eud_absent = require_eud and not any(t in EUD_TESTS for t in col.tests_seen)
    results: list[Result] = []
    for comp in col.components.values():
        r = _judge(comp, require_eud, base)
        if eud_absent and r.status != FAIL:
            continue  # not judged by EUD; the host result below says why
        results.append(r)
    if eud_absent:
        ran = ", ".join(sorted(col.tests_seen)) or "none"
        results.append(Result("host", SKIPPED, "EUD did not run: no eud test in the dcgmi output (EUD not installed,"
                              f" or nvvs not running as root); tests that ran: {ran}",
                              details=dict(base, eud="not run", tests_seen=sorted(col.tests_seen))))
    elif not results:
        results.append(Result("host", SKIPPED, "dcgmi diag reported no test results", details=dict(base)))
    elif any(c.startswith("gpu/") for c in col.components):
        # Spec GPUs the diagnostic never reported on (e.g. excluded by -i).
        judged = set(col.components)
        for gpu in gpus or []:
            idx = _int(gpu.get("index"))
            if idx is not None and gpu_component(gpus, idx) not in judged:
                results.append(Result(gpu_component(gpus, idx), SKIPPED,
                                      f"GPU {idx} is not in the dcgmi diag output", details=dict(base)))
    results.sort(key=lambda r: (r.component == "host", r.component))
    return results
