"""Authenticated states: rank 0 signs each manifest with HMAC-SHA256; selection verifies it.

Why: a manifest's checksums prove a state's files are the ones committed, not *who* committed
them: anyone with write access to storage can write files and a matching manifest. With
``checkpoint.signing_key_env: NAME`` the manifest carries an HMAC over its canonical bytes with
the key from that environment variable (a Kubernetes Secret in the k8s flavours). The manifest
lists every file's size and sha256, so the signature covers every byte of the state. A state
without a valid signature is *untrusted* at selection, before anything else of it is read.

Hand-written because no checkpoint library signs states; it is the standard library's ``hmac``
over a canonical JSON encoding (sorted keys, no whitespace), compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

from policies.errors import JobConfigError

SIGNATURE = "signature"
ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 32


def canonical_bytes(manifest: dict[str, Any]) -> bytes:
    """The bytes a signature covers: the manifest without its signature, canonically encoded."""
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(manifest: dict[str, Any], key: bytes) -> dict[str, Any]:
    mac = hmac.new(key, canonical_bytes(manifest), hashlib.sha256).hexdigest()
    return {**manifest, SIGNATURE: {"algorithm": ALGORITHM, "value": mac}}


def trust_problem(manifest: dict[str, Any], key: bytes) -> str | None:
    """``None`` when the manifest is signed with ``key``; else why the state is untrusted."""
    sig = manifest.get(SIGNATURE)
    if not isinstance(sig, dict):
        return ("unsigned: checkpoint.signing_key_env is set, and this state carries no signature (written "
                "without the key, or by someone else)")
    if sig.get("algorithm") != ALGORITHM or not isinstance(sig.get("value"), str):
        return f"signature algorithm {sig.get('algorithm')!r} is not {ALGORITHM}"
    expected = hmac.new(key, canonical_bytes(manifest), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, sig["value"]):
        return "signature does not match this run's key (written or changed by someone without it)"
    files = manifest.get("files")
    if isinstance(files, dict) and any(not (isinstance(i, dict) and "sha256" in i) for i in files.values()):
        return "signed, but not every file carries a sha256 (a non-cryptographic checksum authenticates nothing)"
    return None


def load_key(env_name: str | None, field: str = "checkpoint.signing_key_env") -> bytes | None:
    """The key from the named environment variable (on every worker), or None when signing is off."""
    if not env_name:
        return None
    value = os.environ.get(env_name, "")
    if not value:
        raise JobConfigError(f"{field}: the environment variable {env_name} is not set on this worker; set it "
                             "on every node (the k8s flavours take it from the Secret syncpoint-signing-key), or "
                             f"remove {field} to run without signed states")
    key = value.encode()
    if len(key) < MIN_KEY_BYTES:
        raise JobConfigError(f"{field}: the key in {env_name} has {len(key)} bytes; use at least {MIN_KEY_BYTES} "
                             "random bytes (e.g. `openssl rand -hex 32`)")
    return key
