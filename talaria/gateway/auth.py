"""Who may call what: user keys with their tenants, the admin key, the peer key (docs/security.md).

- `/v1/*`: a user key (`[server] api_key`, tenant "default", or one of `[[server.api_keys]]`), or
  the peer key, with which another node forwards a call on behalf of the tenant it names in
  `X-Talaria-Tenant`. With no user key configured, `/v1` is open and every caller is tenant
  "default".
- `/talaria/admin/*` and `/talaria/events`: the admin key; with none configured, loopback clients only.
- `/talaria/telemetry` (session listings included): the admin key or the peer key; with neither
  configured, loopback clients only.
- `/health` and `/metrics` are open: they carry no session, prompt or tenant.
- With `[server] peer_port`, the peer key opens only that port, and that port opens only to it
  (`/health` and `/metrics` aside): telemetry and forwarded calls there, nothing of it on the client
  port, so a network policy that confines the peer port to the node set confines the key's rights.

A key is read from `Authorization: Bearer <key>` (OpenAI's way) or `x-api-key` (Anthropic's) and
compared in constant time. A missing key is a 401, a key without the right is a 403.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

from starlette.requests import Request

from talaria.config.schema import ServerConfig
from talaria.gateway.errors import AUTHENTICATION, PERMISSION, APIError

DEFAULT_TENANT = "default"
TENANT_HEADER = "x-talaria-tenant"  # a peer's forward names the tenant it calls for


def presented_key(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "").strip()


def _is(token: str, key: str | None) -> bool:
    return key is not None and hmac.compare_digest(token.encode(), key.encode())


def _loopback(request: Request) -> bool:
    host = request.client.host if request.client is not None else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Keys:
    def __init__(self, server: ServerConfig) -> None:
        self.users: dict[str, str] = {k.key: k.tenant for k in server.api_keys}
        if server.api_key is not None:
            self.users[server.api_key] = DEFAULT_TENANT
        self.admin = server.admin_key
        self.peer = server.peer_key
        self.peer_port = server.peer_port

    def tenant(self, request: Request) -> str:
        """The tenant a `/v1` call is made for; raises a 401 without a valid key."""
        if self._at_peer_port(request):
            self._require(request, (self.peer,), "the peer key", "peer_key")
            return self._forwarded(request)
        if not self.users:
            return DEFAULT_TENANT if not self._peer_call(request) else self._forwarded(request)
        token = presented_key(request)
        if not token:
            raise _missing()
        for key, tenant in self.users.items():  # a handful of keys: constant time for each
            if _is(token, key):
                return tenant
        if _is(token, self.peer) and self.peer_port is None:
            return self._forwarded(request)
        raise APIError(401, "Incorrect API key provided.", AUTHENTICATION, None, "invalid_api_key",
                       {"WWW-Authenticate": "Bearer"})

    def admin_only(self, request: Request) -> None:
        """`/talaria/admin/*` and the event stream."""
        if self._at_peer_port(request):
            raise APIError(403, "the peer port serves other Talaria nodes only; use the client port",
                           PERMISSION, None, "peer_port_only")
        self._require(request, (self.admin,), "the admin key", "admin_key")

    def telemetry(self, request: Request) -> None:
        if self._at_peer_port(request):
            self._require(request, (self.peer,), "the peer key", "peer_key")
        elif self.peer_port is not None:  # the peer key opens the peer port only
            self._require(request, (self.admin,), "the admin key (peers read it on the peer port)", "admin_key")
        else:
            self._require(request, (self.admin, self.peer), "the admin or peer key", "admin_key or peer_key")

    def _at_peer_port(self, request: Request) -> bool:
        """The request came in on `[server] peer_port` (the listening socket's port, not a header)."""
        server = request.scope.get("server")
        return self.peer_port is not None and server is not None and server[1] == self.peer_port

    def _require(self, request: Request, keys: tuple[str | None, ...], what: str, setting: str) -> None:
        keys = tuple(k for k in keys if k is not None)
        if not keys:
            if _loopback(request):
                return
            raise APIError(403, f"this endpoint answers loopback clients only while [server] {setting} is unset",
                           PERMISSION, None, "loopback_only")
        token = presented_key(request)
        if not token:
            raise _missing()
        if not any(_is(token, k) for k in keys):
            raise APIError(403, f"this endpoint needs {what}; a user key does not give access to it",
                           PERMISSION, None, "permission_denied")

    def _peer_call(self, request: Request) -> bool:
        return TENANT_HEADER in request.headers and _is(presented_key(request), self.peer) and self.peer_port is None

    def _forwarded(self, request: Request) -> str:
        return request.headers.get(TENANT_HEADER, "").strip() or DEFAULT_TENANT


def cache_namespace(tenant: str, salt: str | None) -> str | None:
    """What separates a call's cached prefixes, session ids and conversations from other calls':
    its tenant and its request's `cache_salt` (hashed: a namespace is printable and bounded, fit
    for a header); None, shared as before tenants, for the default tenant without a salt."""
    if tenant == DEFAULT_TENANT and salt is None:
        return None
    if salt is None:
        return tenant
    return f"{tenant}|{hashlib.blake2b(salt.encode(), digest_size=8).hexdigest()}"  # tenant names have no "|"


def _missing() -> APIError:
    return APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
                    "(or 'x-api-key: <key>').", AUTHENTICATION, None, "missing_api_key",
                    {"WWW-Authenticate": "Bearer"})
