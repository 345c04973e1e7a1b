"""The per-run admin token of the local control plane (docs/architecture.md §2.3).

The rollout makes one token for the engines and the router it starts (``new_token``) and hands it to them
through the environment (``ADMIN_TOKEN_ENV``; an argument would be readable by every local user in the
process list). The embedded engine requires it on its admin routes, the SGLang router on its worker admin
API; callers send it as ``Authorization: Bearer <token>`` (``bearer``). Every check compares in constant
time (``authorized``), as the coordinator API does with ``api.token``. Where services in separate containers
must share one token (two rollouts on one engine fleet), each is given the same mounted secret file
(``ADMIN_TOKEN_FILE_ENV``) instead of an environment value.
"""

from __future__ import annotations

import hmac
import os
import secrets

ADMIN_TOKEN_ENV = "TANDEM_ADMIN_TOKEN"
ADMIN_TOKEN_FILE_ENV = "TANDEM_ADMIN_TOKEN_FILE"


def new_token() -> str:
    """A fresh random token (256 bits, hex: it never starts with '-', so no command line takes it for a flag)."""
    return secrets.token_hex(32)


def token_from_env() -> str | None:
    """The admin token this process was given: ``$TANDEM_ADMIN_TOKEN``, else the content of the file that
    ``$TANDEM_ADMIN_TOKEN_FILE`` names (a ``ConfigError`` naming the variable if it is unreadable or empty),
    or None."""
    if os.environ.get(ADMIN_TOKEN_ENV):
        return os.environ[ADMIN_TOKEN_ENV]
    path = os.environ.get(ADMIN_TOKEN_FILE_ENV)
    if not path:
        return None
    from services.contracts.config import read_secret  # here: the router's wrapper imports this module lean

    return read_secret(ADMIN_TOKEN_FILE_ENV, path)


def bearer(token: str | None) -> dict[str, str]:
    """The request headers that carry ``token`` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def authorized(authorization: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``token`` as a bearer token (constant-time compare)."""
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {token}".encode())
