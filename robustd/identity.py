"""What an `authz.disruptive.identities` entry names: a certificate name of one type (RFC 6125).

Kept apart from robustd/authz.py, which matches callers against these entries at every call, so that the
config loader can validate an entry at load without importing the authorizer (and the authorizer can
import the config's models without a circle).
"""

from __future__ import annotations

import ipaddress


def parse_identity(entry: str) -> tuple[str, str]:
    """(type, name) of one `identities` entry; the type is dns, uri, email or ip, or "" for a plain name.

    RFC 6125: a name counts only as the SAN type it is written for, so an email or URI SAN that spells an
    allowed host name grants nothing. A plain name matches a DNS SAN, or the CN of a certificate without
    any SAN; `spiffe://…` is a URI even without `uri:`. Raises ValueError saying what is wrong.
    """
    if not entry or entry != entry.strip() or not entry.isprintable():
        raise ValueError("an identity is a non-empty name without control characters or outer spaces")
    head, sep, name = ("uri", ":", entry) if entry.startswith("spiffe://") else entry.partition(":")
    if not sep:
        return "", entry  # may hold spaces: a CN is not always a host name
    if any(c.isspace() for c in entry):
        raise ValueError("a typed identity has no spaces")
    kind = head.lower()
    if kind not in ("dns", "uri", "email", "ip"):
        raise ValueError(f"unknown identity type {head + ':'!r} (known: dns:, uri:, email:, ip:; a name without a "
                         "type matches a DNS SAN, or the CN of a certificate without SANs)")
    if not name:
        raise ValueError(f"nothing after {head + ':'!r}")
    if kind == "ip":
        try:
            ipaddress.ip_address(name)
        except ValueError:
            raise ValueError(f"{name!r} is not an IP address") from None
    elif kind == "email" and "@" not in name[1:-1]:
        raise ValueError(f"{name!r} is not an email address")
    elif kind == "uri" and ":" not in name[1:]:
        raise ValueError(f"{name!r} is not a URI (it has no scheme, e.g. spiffe://…)")
    elif kind == "dns" and any(c in name for c in "/@:"):
        raise ValueError(f"{name!r} is not a DNS name")
    return kind, name
