"""Who may call what: caller identity per RPC, and the allowlist for disruptive RPCs.

Identity comes from the transport:

- TCP with TLS: the client certificate's names by type (DNS, URI, email and IP SANs, and the CN), from the
  call's auth context. Matching follows RFC 6125: an entry of `authz.disruptive.identities` names its type
  (`dns:`, `uri:`, `email:`, `ip:`; `spiffe://…` is a URI); a plain name matches a DNS SAN, or the CN only
  when the certificate has no SANs at all. An email or URI SAN that happens to spell an allowed host name
  grants nothing.
- The Unix socket: the peer's uid, gid and supplementary groups, read when the connection was accepted
  (robustd/relay.py, which maps gRPC's peer name back to them).

Read-only RPCs are open to any caller the transport admitted (with `listen.tls.client_ca`, only holders of
a certificate that CA signed). Disruptive RPCs need an allowed identity: a certificate name in
`authz.disruptive.identities`, or on the Unix socket uid 0 or a member of a group in
`authz.disruptive.unix_groups`. Without an identity the answer is UNAUTHENTICATED, with one that is not
allowed PERMISSION_DENIED; either way the method never runs. Refusals are logged per caller (a uid, a
certificate) and method: the first at once, the rest of a flood counted and summarised once per 10 s
(robustd/ratelog.py), so one caller's retry loop cannot push the daemon's own lines out of the journal.
"""

from __future__ import annotations

import grp
import ipaddress
import logging
import ssl
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

import grpc

from robustd.config import AuthzConfig
from robustd.identity import parse_identity
from robustd.ratelog import RateLimitedLogs
from robustd.relay import UnixFront, UnixPeer

log = logging.getLogger("robustd.authz")

# Full method names of the RPCs that change state or load the node.
DISRUPTIVE = frozenset({
    "/robustd.v1.Diagnostics/Run",
    "/robustd.v1.Diagnostics/Cancel",
    "/robustd.v1.Diagnostics/RecordGolden",
    "/robustd.v1.NodeHealth/Acknowledge",
    "/robustd.v1.Tracer/CaptureStacks",  # pauses the training processes while it samples them
    "/robustd.v1.Diagnostics/RecordTriage",  # decides whether the controller holds and tests a job's nodes
})
# The rest of robustd.v1, open to every caller the listener admits. Not consulted by the check (anything
# not DISRUPTIVE is open); a test makes every method of the API appear in exactly one of the two sets, so a
# new RPC is classified on purpose.
READ_ONLY = frozenset({
    "/robustd.v1.NodeHealth/GetVerdict",
    "/robustd.v1.NodeHealth/Watch",
    "/robustd.v1.NodeHealth/ListEvents",
    "/robustd.v1.NodeHealth/ListChecks",
    "/robustd.v1.Diagnostics/Get",
    "/robustd.v1.Diagnostics/List",
    "/robustd.v1.Diagnostics/ListGoldens",
    "/robustd.v1.Diagnostics/Triage",  # pure: judges the logs it is sent, touches nothing on the node
    "/robustd.v1.Diagnostics/GetTriage",
    # Evidence: what the reads above already show, kept; Create is what the adapters call before they act, so it
    # is open too, and bounded for unprivileged callers (evidence.max_creates_per_minute, robustd/api/evidence.py).
    "/robustd.v1.Evidence/Create",
    "/robustd.v1.Evidence/List",
    "/robustd.v1.Evidence/Get",
})
NO_IDENTITY = "callers without an identity"  # their refusals are counted together
_SAN_OID = bytes.fromhex("0603551d11")  # DER of OID 2.5.29.17, subjectAltName


@dataclass(frozen=True)
class CertNames:
    """The names a verified client certificate presents, by type (RFC 6125 reference identifiers)."""

    dns: tuple[str, ...] = ()
    uri: tuple[str, ...] = ()
    email: tuple[str, ...] = ()
    ip: tuple[str, ...] = ()
    cn: tuple[str, ...] = ()
    has_san: bool = False  # any subjectAltName, also of a type gRPC does not report (otherName, dirName)

    def __str__(self) -> str:
        names = [*self.dns, *(f"uri:{n}" for n in self.uri), *(f"email:{n}" for n in self.email),
                 *(f"ip:{n}" for n in self.ip), *(f"CN={n}" for n in self.cn)]
        return ", ".join(_escaped(n) for n in names) or "(no names)"


@dataclass(frozen=True)
class Identity:
    """Who called: a Unix peer, or the names on a verified client certificate."""

    unix: UnixPeer | None = None
    cert: CertNames | None = None

    def __str__(self) -> str:
        return str(self.unix) if self.unix else f"certificate {self.cert}"

    @property
    def caller(self) -> str:
        """Who this is across calls and connections: the uid (not the pid), or the certificate's names."""
        return f"uid {self.unix.uid}" if self.unix else f"certificate {self.cert}"


def _escaped(name: str) -> str:
    """A certificate name made safe for a log line: control and non-ASCII characters as Python escapes."""
    return name if name.isascii() and name.isprintable() else name.encode("unicode_escape").decode("ascii")


def cert_names(auth: dict[str, list[bytes]]) -> CertNames | None:
    """The typed names of a verified peer certificate, from a gRPC auth context (None without one).

    grpcio reports DNS, URI, email and IP SANs by type (`peer_dns`, `peer_uri`, `peer_email`, `peer_ip`;
    seen on 1.85) and all of them untyped in `x509_subject_alternative_name`. Whether the certificate has a
    SAN extension at all (it may hold only types gRPC does not report) is read from the certificate itself;
    when that cannot be told, it counts as having one, so the CN is not used.
    """
    if auth.get("transport_security_type") != [b"ssl"]:
        return None

    def names(key: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n.decode(errors="replace") for n in auth.get(key, [])))

    typed = {k: names(f"peer_{k}") for k in ("dns", "uri", "email", "ip")}
    cn = names("x509_common_name")
    has_san = any(typed.values()) or bool(auth.get("x509_subject_alternative_name")) \
        or _has_san_extension(auth.get("x509_pem_cert", []))
    if not (any(typed.values()) or cn):
        return None
    return CertNames(**typed, cn=cn, has_san=has_san)


def _has_san_extension(pem: list[bytes]) -> bool:
    """True when the certificate carries a subjectAltName extension, or when that cannot be told.

    A byte search for the extension's OID in the DER: it cannot miss one, and a false match only makes
    matching stricter (the CN stops counting), so no X.509 parser is needed for this one question.
    """
    if not pem:
        return True
    try:
        der = ssl.PEM_cert_to_DER_cert(pem[0].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return True
    return _SAN_OID in der


def _dns(name: str) -> str:
    return name.lower().rstrip(".")


def _email(address: str) -> str:
    local, _, domain = address.rpartition("@")
    return f"{local}@{domain.lower()}"


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def identity_matches(kind: str, name: str, cert: CertNames) -> bool:
    """Whether one parsed `authz.disruptive.identities` entry names this certificate (RFC 6125, §6.4).

    DNS names compare case-insensitively, an email's domain too; URIs compare exactly; IP addresses as
    addresses. Wildcards in a certificate are not expanded: an entry matches `*.example` only as written.
    """
    if kind in ("", "dns"):
        if _dns(name) in {_dns(n) for n in cert.dns}:
            return True
        return kind == "" and not cert.has_san and _dns(name) in {_dns(n) for n in cert.cn}
    if kind == "uri":
        return name in cert.uri
    if kind == "email":
        return _email(name) in {_email(n) for n in cert.email}
    if kind == "ip":
        want = _ip(name)
        return want is not None and want in {_ip(n) for n in cert.ip}
    return False


def describe_identity_changes(identities: Iterable[str]) -> list[tuple[int, str]]:
    """Log lines (level, text) for plain entries whose meaning changed with typed matching.

    Before, a plain name matched any SAN or the CN; now it matches a DNS SAN, or the CN of a certificate
    without SANs. A plain name that looks like an email or IP address most likely meant that SAN type and
    now matches nothing it used to: a warning with the entry to write. Host names lose only the loose
    matches: one informational line lists them.
    """
    lines: list[tuple[int, str]] = []
    hosts: list[str] = []
    for entry in identities:
        try:
            kind, name = parse_identity(entry)
        except ValueError:
            continue  # the config validation reported it
        if kind:
            continue
        hint = "email" if "@" in name else "ip" if _ip(name) is not None else ""
        if hint:
            lines.append((logging.WARNING, f"authz.disruptive.identities: {name!r} now matches only a DNS SAN, or "
                                           f"the CN of a certificate without SANs; write '{hint}:{name}' to match "
                                           f"an {'email' if hint == 'email' else 'IP'} SAN"))
        else:
            hosts.append(name)
    if hosts:
        shown = ", ".join(repr(h) for h in hosts[:10]) + (f" and {len(hosts) - 10} more" if len(hosts) > 10 else "")
        verb = "matches" if len(hosts) == 1 else "match"
        lines.insert(0, (logging.INFO, f"authz.disruptive.identities: {shown} now {verb} only a DNS SAN, or the CN "
                                       "of a certificate without SANs; write 'uri:...' or 'email:...' to match those"))
    return lines


# -- authorization ----------------------------------------------------------------------------------------

class Authorizer:
    def __init__(self, config: Callable[[], AuthzConfig], front: UnixFront | None):
        self.config = config
        self.front = front
        self._compiled_for: tuple[str, ...] | None = None
        self._rules: tuple[tuple[str, str], ...] = ()
        self._refusals = RateLimitedLogs(log, "refused calls from further callers")
        self.refresh()

    def close(self) -> None:
        """At shutdown: log the refusals still counted, and stop their timers."""
        self._refusals.flush()

    def refresh(self) -> None:
        """Parse `authz.disruptive.identities` again if they changed, and log which plain names changed meaning.

        Runs at construction (daemon start) and before every disruptive call, so a SIGHUP reload takes
        effect at once; calling it right after a reload logs the notes at reload time.
        """
        entries = tuple(self.config().disruptive.identities)
        if entries == self._compiled_for:
            return
        rules = []
        for entry in entries:
            try:
                rules.append(parse_identity(entry))
            except ValueError as e:  # validated at load; never expected, but an unparsable entry allows no one
                log.error("authz.disruptive.identities: %r ignored: %s", entry, e)
        self._rules = tuple(rules)
        self._compiled_for = entries
        for level, line in describe_identity_changes(entries):
            log.log(level, "%s", line)

    def identify(self, context: grpc.aio.ServicerContext) -> Identity | None:
        peer = context.peer() or ""
        if self.front is not None and peer.startswith("unix:"):
            creds = self.front.lookup(peer)
            return Identity(unix=creds) if creds else None
        cert = cert_names(context.auth_context() or {})
        return Identity(cert=cert) if cert else None

    def allowed(self, ident: Identity) -> bool:
        rules = self.config().disruptive
        if ident.unix is not None:
            if ident.unix.uid == 0:
                return True
            for name in rules.unix_groups:
                try:
                    gid = grp.getgrnam(name).gr_gid
                except KeyError:
                    continue
                if gid in ident.unix.groups:
                    return True
            return False
        if ident.cert is None:
            return False
        self.refresh()
        return any(identity_matches(kind, name, ident.cert) for kind, name in self._rules)

    def _refused(self, caller: str, method: str, msg: str, *args: Any) -> None:
        """Log a refusal: the first of each caller and method at once, the rest of a flood as a count."""
        self._refusals(f"{caller} {method}", f"refused calls to {method} from {caller}", msg, *args)

    async def check(self, method: str, context: grpc.aio.ServicerContext) -> None:
        """Abort the call unless its caller may run `method` (a disruptive one)."""
        ident = self.identify(context)
        if ident is None:
            self._refused(NO_IDENTITY, method, "%s refused: caller %s has no identity", method, context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"{method} needs an authenticated caller (a client certificate or the Unix socket)")
        elif not self.allowed(ident):
            self._refused(ident.caller, method, "%s refused: %s is not allowed", method, ident)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{ident} may not call {method} (see authz.disruptive)")


class AuthzInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the handlers of disruptive methods so the check runs, with the call's context, before them."""

    def __init__(self, authz: Authorizer):
        self.authz = authz

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        method = details.method
        if handler is None or method not in DISRUPTIVE:
            return handler
        authz = self.authz
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await authz.check(method, context)
                return await inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await authz.check(method, context)
                async for msg in inner_us(request, context):
                    yield msg

            return grpc.unary_stream_rpc_method_handler(unary_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        raise RuntimeError(f"{method}: a disruptive method of an unexpected kind")  # fail closed
