"""Who may call what: user keys with their tenants, the admin key, the peer key (docs/security.md).

- `/v1/*`: a user key (`[server] api_key`, tenant "default", or one of `[[server.api_keys]]`), or
  the peer key, with which another node forwards a call on behalf of the tenant it names in
  `X-Talaria-Tenant`. With no user key configured, `/v1` is open and every caller is tenant
  "default".
- `/talaria/admin/*` and `/talaria/events`: the admin key; with none configured, loopback clients only.
- `/talaria/telemetry` (session listings included): the admin key or the peer key; with neither
  configured, loopback clients only.
- `/health` and `/metrics` are open: they carry no session, prompt or tenant.

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

    def tenant(self, request: Request) -> str:
        """The tenant a `/v1` call is made for; raises a 401 without a valid key."""
        if not self.users:
            return DEFAULT_TENANT if not self._peer_call(request) else self._forwarded(request)
        token = presented_key(request)
        if not token:
            raise _missing()
        for key, tenant in self.users.items():  # a handful of keys: constant time for each
            if _is(token, key):
                return tenant
        if _is(token, self.peer):
            return self._forwarded(request)
        raise APIError(401, "Incorrect API key provided.", AUTHENTICATION, None, "invalid_api_key",
                       {"WWW-Authenticate": "Bearer"})

    def admin_only(self, request: Request) -> None:
        """`/talaria/admin/*` and the event stream."""
        self._require(request, (self.admin,), "the admin key", "admin_key")

    def telemetry(self, request: Request) -> None:
        self._require(request, (self.admin, self.peer), "the admin or peer key", "admin_key or peer_key")

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
        return TENANT_HEADER in request.headers and _is(presented_key(request), self.peer)

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
