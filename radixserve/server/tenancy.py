"""Who is asking, and which cache namespace their requests live in.

Every request carries a cache namespace (the cache's ``extra_key``): requests in
different namespaces never share a prefix. The namespace is never a
user-supplied string as such: it is a hash with domain separation,

    no isolation:        salt:<h(cache_salt)>                      (None without a salt: the shared namespace)
    --tenant-isolation:  tenant:<h(tenant)>[/salt:<h(tenant, salt)>]

so no value a client sends can equal another client's namespace or a tenant's,
and in isolation mode the tenant part comes from the authenticated identity (an
API key, or a header set by a trusted proxy), never from the request body: a
client's ``cache_salt`` only splits its own tenant's space further.

Identities: ``--api-key KEY`` (repeatable; the tenant is a hash of the key),
``--api-key-file FILE`` (lines ``TENANT KEY``), ``--tenant-header NAME`` (the
tenant is that header's value; use it only behind a proxy that sets it).
``--admin-api-key`` may flush the cache and see all of ``/cache``; with several
identities nobody else may (``is_operator``), isolation or not: without
``--tenant-isolation`` the tenants share one cache, and one tenant's cached prompt
is another's cache hit, but never its text.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from starlette.datastructures import Headers

from radixserve.server.errors import APIError

ADMIN = "\x00admin"  # an identity no key file or header can produce


def _digest(domain: bytes, *parts: str) -> str:
    h = hashlib.blake2b(digest_size=16, person=domain)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little") + data)  # length-prefixed: ("ab","c") != ("a","bc")
    return h.hexdigest()


def salt_namespace(salt: str | None) -> str | None:
    return None if salt is None else "salt:" + _digest(b"rs-cache-salt", salt)


def tenant_namespace(tenant: str, salt: str | None = None) -> str:
    namespace = "tenant:" + _digest(b"rs-tenant", tenant)
    return namespace if salt is None else namespace + "/salt:" + _digest(b"rs-tenant-salt", tenant, salt)


def read_key_file(path: str | Path) -> dict[str, str]:
    """``TENANT KEY`` per line (blank lines and ``#`` comments skipped) -> {key: tenant}."""
    keys: dict[str, str] = {}
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{lineno}: expected 'TENANT KEY', got {len(parts)} fields")
        tenant, key = parts
        if key in keys:
            raise ValueError(f"{path}:{lineno}: a key is listed twice")
        keys[key] = tenant
    return keys


class CacheScope(NamedTuple):
    """What one caller may see of the cache (``/cache``, ``/dashboard/data``)."""

    visible: Callable[[str | None], bool] | None  # the namespaces shown (None: all, with pool-wide figures)
    show_text: bool  # prompt text (a prefix's head and tail) may be shown


@dataclass(frozen=True)
class Tenancy:
    api_keys: dict[str, str]  # key -> tenant
    admin_key: str | None = None
    tenant_header: str | None = None
    isolation: bool = False

    def __post_init__(self) -> None:
        if self.isolation and not (self.api_keys or self.tenant_header):
            raise ValueError("--tenant-isolation needs identities: --api-key / --api-key-file or --tenant-header")

    @property
    def auth_required(self) -> bool:
        return bool(self.api_keys or self.admin_key)

    def authenticate(self, headers: Headers) -> str | None:
        """The caller's tenant (ADMIN for the admin key; None when nobody is identified); 401 if refused."""
        tenant: str | None = None
        if self.auth_required:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer" or not token:
                raise APIError(401, "Missing API key: send `Authorization: Bearer <key>`.", "invalid_api_key")
            if self.admin_key is not None and secrets.compare_digest(token.encode(), self.admin_key.encode()):
                return ADMIN
            tenant = self._tenant_of(token)
            if tenant is None:
                raise APIError(401, "Incorrect API key.", "invalid_api_key")
        if self.tenant_header is not None:
            value = headers.get(self.tenant_header)
            if not value:
                raise APIError(401, f"Missing the {self.tenant_header} header.", "missing_tenant")
            tenant = value
        return tenant

    def is_operator(self, tenant: str | None) -> bool:
        """May ``tenant`` flush the cache and read prompt text in /cache?

        The admin key, always. Otherwise only where nobody else could be exposed: no admin
        key, no isolation, and at most one identity (no key, or a single --api-key).
        """
        if tenant == ADMIN:
            return True
        single = len(set(self.api_keys.values())) <= 1 and self.tenant_header is None
        return self.admin_key is None and not self.isolation and single

    def cache_scope(self, tenant: str | None) -> CacheScope:
        """Under isolation a tenant sees its own namespaces only, with their text; otherwise all of them, with
        text for an operator only (the cache is shared: one tenant's prompt is never another's to read)."""
        if self.isolation and not self.is_operator(tenant):
            own = self.namespace(tenant, None) or ""
            return CacheScope(lambda ns: ns is not None and ns.startswith(own), True)
        return CacheScope(None, self.is_operator(tenant))

    def namespace(self, tenant: str | None, salt: str | None) -> str | None:
        """The cache namespace of a request from ``tenant`` carrying ``salt`` (cache_salt / extra_key)."""
        if self.isolation and tenant is not None and tenant != ADMIN:
            return tenant_namespace(tenant, salt)
        return salt_namespace(salt)

    def _tenant_of(self, token: str) -> str | None:
        found = None
        for key, tenant in self.api_keys.items():  # compare with every key: no early exit to time
            if secrets.compare_digest(token.encode(), key.encode()):
                found = tenant
        return found


def key_tenant(key: str) -> str:
    """The tenant a bare ``--api-key`` stands for: a hash, so the key itself never appears anywhere."""
    return "key-" + _digest(b"rs-key-tenant", key)[:16]
