"""API-key check for /v1/* routes and POST /flush_cache: a Bearer token or an x-api-key header
(constant-time compare); /health, /metrics and the routers' read-only endpoints (/get_load,
/server_info, ...) stay open, as probes and scrapers send no key."""

from __future__ import annotations

import hmac

from sparkinfer_cli.server.protocol import ApiError

PROTECTED_PREFIX = "/v1/"
PROTECTED_PATHS = frozenset({"/flush_cache"})  # outside /v1, but it changes the server's state


def bearer_token(authorization: str | None) -> str | None:
    """'Bearer <token>' (scheme case-insensitive) → token; anything else → None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def is_authorized(authorization: str | None, api_key: str) -> bool:
    token = bearer_token(authorization)
    # compare_digest on bytes: constant time for equal lengths, no early exit on the first mismatch
    return token is not None and hmac.compare_digest(token.encode(), api_key.encode())


def is_protected(path: str) -> bool:
    return path.startswith(PROTECTED_PREFIX) or path.rstrip("/") in PROTECTED_PATHS


def check_request(path: str, authorization: str | None, api_key: str | None,
                  x_api_key: str | None = None) -> None:
    """Raise a 401 OpenAI error when a key is configured and the request does not carry it, as
    a Bearer token or (Anthropic's way) in an x-api-key header."""
    if api_key is None or not is_protected(path):
        return
    by_header = x_api_key is not None and hmac.compare_digest(x_api_key.encode(),
                                                              api_key.encode())
    if not by_header and not is_authorized(authorization, api_key):
        missing = bearer_token(authorization) is None and x_api_key is None
        raise ApiError(
            401,
            "Missing API key: send 'Authorization: Bearer <key>'" if missing else "Invalid API key",
            type="authentication_error", code="invalid_api_key",
            headers={"WWW-Authenticate": 'Bearer realm="sparkinfer"'})
