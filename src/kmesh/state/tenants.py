"""Tenants from credentials: `kmesh serve --api-keys FILE` and `kmesh store serve --api-keys FILE`.

The file is a JSON object, API key -> tenant name, e.g. `{"sk-team-a-1": "team-a"}`; several
keys may name one tenant. With keys set, every route but GET /health and GET /metrics needs
`Authorization: Bearer KEY` with a key of the file (else 401), and each request runs under its
key's tenant: the tenant is part of every state key (the prefix cache's, the store's, recovery's),
so a request never reuses, restores or times another tenant's state, whatever `cache_salt` it
sends. A client's `cache_salt` only subdivides its own tenant (`tenant_salt`). The store does the
same for the engines that share it (kmesh/store/state_machine.py: a connection says hello with a
key).

Keys are held as SHA-256 digests and looked up by digest, so the lookup takes the same time
whichever key (or non-key) is presented.
"""

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from kmesh.errors import InvalidRequestError

# Letters, digits, '.', '_' and '-': never the separator's '#'.
TENANT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
SEPARATOR = "#tenant="
MIN_KEY_CHARS = 8


class AuthenticationError(Exception):
    """A request without a valid API key (HTTP 401)."""


@dataclass(frozen=True, slots=True)
class ApiKeys:
    # SHA-256 of each key -> its tenant.
    tenants: dict[bytes, str]

    def tenant(self, authorization: str | None) -> str:
        """The tenant of an `Authorization` header's bearer key; raises AuthenticationError."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError(
                "this server needs an API key: send the header `Authorization: Bearer KEY` "
                "(the OpenAI client's api_key)"
            )
        tenant = self.tenant_of_key(key.strip())
        if tenant is None:
            raise AuthenticationError("the API key is not valid: use a key this server was given")
        return tenant

    def tenant_of_key(self, key: str) -> str | None:
        return self.tenants.get(_digest(key))


def tenant_salt(tenant: str, cache_salt: str | None) -> str:
    """The salt a tenant's request runs under: the client's salt, then the tenant. An
    approximate salt stays one (its prefix is kept), and since a tenant name holds no '#' the
    tenant is what follows the last SEPARATOR: no client salt can name another tenant's
    namespace."""
    return f"{cache_salt or ''}{SEPARATOR}{tenant}"


def tenant_of_salt(salt: str | None) -> str | None:
    """The tenant a salt belongs to: what follows its last SEPARATOR (tenant_salt's), None for
    a salt without one (the shared namespace, or a server without keys)."""
    if salt is None or SEPARATOR not in salt:
        return None
    return salt.rpartition(SEPARATOR)[2]


def load_api_keys(path: str | Path) -> ApiKeys:
    """The keys of an --api-keys file; raises InvalidRequestError saying what to fix."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise InvalidRequestError(f"--api-keys: cannot read {path}: {error.strerror}") from None
    try:
        given = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidRequestError(
            f"--api-keys: {path} is not JSON ({error.msg}, line {error.lineno}): write an "
            'object of API key -> tenant, like {"sk-team-a-1": "team-a"}'
        ) from None
    if not isinstance(given, dict) or not given:
        raise InvalidRequestError(
            f"--api-keys: {path} must hold a non-empty object of API key -> tenant, like "
            '{"sk-team-a-1": "team-a"}'
        )
    tenants = {}
    for key, tenant in given.items():
        if len(key) < MIN_KEY_CHARS or key != key.strip() or " " in key:
            raise InvalidRequestError(
                f"--api-keys: a key of {path} is shorter than {MIN_KEY_CHARS} characters or "
                "holds spaces: use long random keys"
            )
        if not isinstance(tenant, str) or not TENANT_NAME.match(tenant):
            raise InvalidRequestError(
                f"--api-keys: tenant {tenant!r} of {path}: a tenant name is 1-64 letters, "
                "digits, '.', '_' or '-'"
            )
        tenants[_digest(key)] = tenant
    return ApiKeys(tenants)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
