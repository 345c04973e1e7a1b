"""Who a caller is: the SDK's JWT exchange (``/api/v1/auth/token``) with this server as the issuer.

With ``jwt_auth`` on, the client config tells the SDK to trade its credential (an API key, or anything
on an open server) for a short-lived HS256 JWT signed with a secret kept in ``data_dir/jwt_secret``; the
SDK then sends the JWT in ``X-API-Key`` and ``RestClient.whoami`` reads its claims. The principal is
``tml:user:local`` on an open server and ``tml:user:key-<12 hex of the key's SHA-256>`` with API keys,
in the organization ``tml:organization:local``. A JWT this server did not sign, or one past ``exp``, is
answered 401 ``invalid_token``, on which the SDK exchanges its credential again and replays the request.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from pathlib import Path

from pydantic import BaseModel

ISSUER = "tandem"
LIFETIME_S = 3600
ORG = "local"


class Claims(BaseModel):
    iss: str
    sub: str
    org_id: str
    email: str = ""
    iat: int
    exp: int


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def load_secret(data_dir: Path) -> bytes:
    """The signing secret, made once (0600) so JWTs outlive a restart of the server."""
    path = data_dir / "jwt_secret"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return path.read_bytes().strip()
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return path.read_bytes().strip()


def principal(credential: str, keyed: bool) -> str:
    """The user URN of a credential: one local user on an open server, one per API key otherwise."""
    if not keyed:
        return "tml:user:local"
    return "tml:user:key-" + hashlib.sha256(credential.encode()).hexdigest()[:12]


def is_jwt(value: str) -> bool:
    return value.startswith("eyJ") and value.count(".") == 2


def mint(secret: bytes, sub: str, now: float | None = None) -> str:
    iat = int(time.time() if now is None else now)
    claims = Claims(iss=ISSUER, sub=sub, org_id=ORG, iat=iat, exp=iat + LIFETIME_S)
    head = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())
    body = _b64(claims.model_dump_json().encode())
    sig = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(sig)}"


def verify(secret: bytes, token: str, now: float | None = None) -> Claims | None:
    """The token's claims when this server signed it and it has not expired; None otherwise."""
    try:
        head, body, sig = token.split(".")
        want = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
        if not hmac.compare_digest(_unb64(sig), want):
            return None
        claims = Claims.model_validate_json(_unb64(body))
    except ValueError:
        return None
    if claims.iss != ISSUER or claims.exp <= (time.time() if now is None else now):
        return None
    return claims
