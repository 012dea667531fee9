"""Deployment secrets for the wire: the API key, the KV-hash salt, and the key of K/V handoffs
between a fleet's gateway and workers. Each may come from the environment, because a process's
arguments are public (any local user reads them in `ps`) and its environment is not."""

from __future__ import annotations

import hashlib
import hmac
import os

API_KEY_ENV = "SHOAL_API_KEY"  # `shoal serve`, `shoal fleet up`, `shoal gateway` and their clients
KV_SALT_ENV = "SHOAL_KV_SALT"
KV_TRANSFER_KEY_ENV = "SHOAL_KV_TRANSFER_KEY"
KV_TRANSFER_KEY_HEADER = "x-shoal-kv-key"


def kv_salt(explicit: str | None = None, api_key: str | None = None) -> bytes:
    """The salt of this deployment's block hashes: the given one, else $SHOAL_KV_SALT, else one
    derived from the API key (a gateway holding the key derives the same), else none: a server
    without a key answers every client anyway."""
    salt = explicit or os.environ.get(KV_SALT_ENV)
    if salt:
        return salt.encode()
    if api_key:
        return hmac.new(api_key.encode(), b"shoal kv salt", hashlib.sha256).digest()
    return b""


def api_key_from(flag: str | None) -> str | None:
    """The API key given by flag, else $SHOAL_API_KEY; an empty one is none."""
    return flag or os.environ.get(API_KEY_ENV) or None
