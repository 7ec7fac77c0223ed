"""`robustctl evidence`: the evidence bundles robustd keeps (the Evidence service): list, show, export, create.

`export ID FILE` writes a tar.gz an operator attaches to an RMA: the bundle's JSON and a short README.txt.
Exit codes (robustd/cli/exitcodes.py): 0 done, 3 daemon unreachable, 4 an RPC error (NOT_FOUND for an unknown
id, INVALID_ARGUMENT for a malformed one), 73 (sysexits EX_CANTCREAT) when FILE cannot be written, 64 a usage error.
"""

from __future__ import annotations

import argparse
import io
import tarfile
import time
from typing import Any

from robustd import atomicfile
from robustd.api.v1 import robustd_pb2 as pb
from robustd.cli import exitcodes, output, render
from robustd.cli.args import AddGlobals, verbs
from robustd.cli.client import CliError

README = """robustd evidence bundle {id}

{id}.json is what robustd on node {node} knew when it was asked for this bundle ({created}), for the
reason: {reason}

  verdict       the node's verdict and every standing condition at that moment
  events        the newest events of the components involved ({components})
  kernel_log    the kernel-log lines that raised them, as the kernel check read them
  gpus          the GPU inventory; NVML's last readings for the GPUs involved
  diagnostics   the newest stop-time diagnostic reports
  versions      robustd's and the GPU driver's
  trimmed       what was left out to keep the bundle within evidence.max_bundle_bytes (empty: nothing)

Made by `robustctl evidence export`; read it with any JSON tool (jq . {id}.json).
"""


def add_parser(p: argparse.ArgumentParser, add_globals: AddGlobals) -> None:
    verb = verbs(p, "evidence_command", add_globals)
    ls = verb("list", "the newest bundles, newest first", "robustctl evidence list --limit 5")
    ls.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")
    ls.add_argument("--wide", action="store_true", help="full reasons: do not cut the last column to the terminal")
    verb("show", "one bundle's JSON", "robustctl evidence show ev-20261203T061500.123Z-a1b2c3").add_argument("id")
    x = verb("export", "write one bundle as a tar.gz (bundle JSON and README.txt), e.g. for an RMA",
             "robustctl evidence export ev-20261203T061500.123Z-a1b2c3 rma-1234.tar.gz")
    x.add_argument("id")
    x.add_argument("file", help="the tar.gz to write")
    c = verb("create", "make a bundle now (what the adapters do before a drain or cordon)",
             "robustctl evidence create --component gpu/0000:1b:00.0 --code XID_79 --reason 'before RMA'")
    c.add_argument("--component", action="append", default=[], help="a component involved (repeatable)")
    c.add_argument("--code", action="append", default=[], help="a condition code involved (repeatable)")
    c.add_argument("--reason", default="", help="why, kept in the bundle")


def run(client: Any, args: argparse.Namespace) -> int:
    cmd = args.evidence_command
    if cmd == "list":
        resp = client.call("List", pb.ListEvidenceRequest(limit=args.limit), "Evidence")
        rows = [[b.id, render.local_time(b.created), ",".join(b.components) or "-", b.reason or "-"]
                for b in resp.bundles]
        output.out(render.to_json(resp) if args.json else
                   (render.table(["ID", "CREATED", "COMPONENTS", "REASON"], rows, output.width(args.wide))
                    if rows else "no evidence bundles"),
                   exact=args.json)
        return 0
    if cmd == "create":
        made = client.call("Create", pb.CreateEvidenceRequest(components=args.component, codes=args.code,
                                                              reason=args.reason), "Evidence")
        output.out(render.to_json(made) if args.json else render.printable(made.id), exact=args.json)
        return 0
    bundle = client.call("Get", pb.GetEvidenceRequest(id=args.id), "Evidence")
    if cmd == "show":
        output.out(bundle.json.rstrip("\n"), exact=True)  # JSON as kept: json.dumps escaped every control character
        return 0
    try:
        export(bundle.id, bundle.json, args.file)
    except OSError as e:
        raise CliError(exitcodes.CANTCREAT, f"evidence export: {e.filename or args.file}: {e.strerror or e}") from None
    output.out(render.printable(f"wrote {args.file} ({bundle.id}.json, README.txt)"))
    return 0


def export(ident: str, text: str, path: str) -> None:
    """`path` as a tar.gz of `<id>/<id>.json` and `<id>/README.txt`, written beside it and renamed into place."""
    import json

    try:
        d = json.loads(text)
    except ValueError:
        d = {}
    readme = README.format(id=ident, node=d.get("node", "?"), created=d.get("created", "?"),
                           reason=d.get("reason") or "(none given)", components=", ".join(d.get("components", ()))
                           or "none")
    with atomicfile.replacing(path) as tmp, tarfile.open(tmp, "w:gz") as tar:
        for name, data in ((f"{ident}.json", text.encode()), ("README.txt", readme.encode())):
            info = tarfile.TarInfo(f"{ident}/{name}")
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(data))
