"""The API-key check shared by the replica server and the gateway."""

from __future__ import annotations

import hmac


def bearer_matches(authorization: str, key: str) -> bool:
    """Whether an `Authorization: Bearer <key>` header carries `key` (compared in constant time)."""
    given = authorization[7:] if authorization[:7].lower() == "bearer " else ""
    return hmac.compare_digest(given.encode(), key.encode())
