"""Encryption keys as users write them: base64 text of 32 random bytes (`openssl rand -base64 32`).

Parsing lives here, below the store, so that config validates `s3.key_file` with the same rule
that tqstore/store/crypto.py applies when it opens the key.
"""

from __future__ import annotations

import base64
import binascii

from tqstore.errors import ConfigError


def parse_key(text: str, source: str) -> bytes:
    """32 key bytes from base64 text; ConfigError naming `source` otherwise."""
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != 32:
        raise ConfigError(f"the S3 encryption key from {source} is not base64 of 32 bytes: create one with "
                          "`openssl rand -base64 32`")
    return key
