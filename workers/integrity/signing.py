"""Authenticated states: rank 0 signs each manifest with HMAC-SHA256; selection verifies it.

Why: a manifest's checksums prove a state's files are the ones committed, not *who* committed
them: anyone with write access to storage can write files and a matching manifest. With
``checkpoint.signing_key_env: NAME`` the manifest carries an HMAC over its canonical bytes with
the key from that environment variable (a Kubernetes Secret in the k8s flavours). The manifest
lists every file's size and sha256, so the signature covers every byte of the state. A state
without a valid signature is *untrusted* at selection, before anything else of it is read.

What a signature binds (``binding``, inside the signed bytes): the run directory that wrote the
state (its location: the storage protocol and path, credentials left out), the state's name, and
the job identity. So a signed state copied into another run directory that uses the same key and
job name (another storage prefix, a second run of the same job), or renamed to look newer, is
untrusted there: the key proves who wrote it, the binding where and as what. The manifest's
``lease_generation`` (the fencing token of its writer) is inside the signed bytes too. What the
binding cannot tell apart: two runs at the same location (the same run directory, by definition).
Manifests signed before the binding existed carry none: they stay trusted by the key alone (with
a warning), since no later writer can add one without the key.

Hand-written because no checkpoint library signs states; it is the standard library's ``hmac``
over a canonical JSON encoding (sorted keys, no whitespace), compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.errors import JobConfigError

SIGNATURE = "signature"
BINDING = "binding"
ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 32
_HEX = frozenset("0123456789abcdef")


def run_location(run_url: str) -> str:
    """Where a run directory is, as a signature binds it: protocol and path, no credentials and no
    trailing slash (``file:///data/runs/job`` and ``/data/runs/job`` are one location)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(run_url)
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    return f"{protocol}://{str(root).rstrip('/')}"


def binding_of(run_url: str, state: str, job_identity: str) -> JSONObject:
    """What a state's signature binds (module docstring)."""
    return {"run": run_location(run_url), "state": state, "job_identity": job_identity}


def canonical_bytes(manifest: JSONObject) -> bytes:
    """The bytes a signature covers: the manifest without its signature, canonically encoded."""
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(manifest: JSONObject, key: bytes) -> JSONObject:
    """The manifest with its HMAC-SHA256 signature over its canonical bytes."""
    mac = hmac.new(key, canonical_bytes(manifest), hashlib.sha256).hexdigest()
    return {**manifest, SIGNATURE: {"algorithm": ALGORITHM, "value": mac}}


def trust_problem(
    manifest: JSONObject,
    key: bytes,
    *,
    run_url: str | None = None,
    state: str | None = None,
    job_identity: str | None = None,
) -> str | None:
    """``None`` when the manifest is signed with ``key`` and bound to this run directory, state name
    and (when given) job identity; else why the state is untrusted. ``run_url``/``state`` None: the
    binding is not checked (a caller that only asks whether the key signed it)."""
    sig = manifest.get(SIGNATURE)
    if not isinstance(sig, dict):
        return (
            "unsigned: checkpoint.signing_key_env is set, and this state carries no signature (written "
            "without the key, or by someone else)"
        )
    if sig.get("algorithm") != ALGORITHM:
        return f"signature algorithm {_short(sig.get('algorithm'))} is not {ALGORITHM}"
    value = sig.get("value")
    if not isinstance(value, str) or len(value) != 64 or not set(value) <= _HEX:
        return f"signature value {_short(value)} is not a {ALGORITHM} (64 hex digits)"
    expected = hmac.new(key, canonical_bytes(manifest), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, value):
        return "signature does not match this run's key (written or changed by someone without it)"
    files = manifest.get("files")
    if isinstance(files, dict) and any(not (isinstance(i, dict) and "sha256" in i) for i in files.values()):
        return "signed, but not every file carries a sha256 (a non-cryptographic checksum authenticates nothing)"
    if run_url is None or state is None:
        return None
    return _binding_problem(manifest.get(BINDING), run_url, state, job_identity)


def _binding_problem(bound: Any, run_url: str, state: str, job_identity: str | None) -> str | None:
    if bound is None:
        return None  # a signature without a binding: trusted by the key alone (legacy_unbound says so)
    if not isinstance(bound, dict):
        return f"signature binding is {_short(bound)}, not an object: refused"
    here = run_location(run_url)
    if bound.get("run") != here:
        return (
            f"signed for another run directory ({_short(bound.get('run'))}), not this one ({here}): a signed state "
            "is trusted only where it was written; take weights from another run with resume.init_from"
        )
    if bound.get("state") != state:
        return f"signed as state {_short(bound.get('state'))}, found as {state}: renamed after it was signed"
    if job_identity is not None and bound.get("job_identity") != job_identity:
        return f"signed for job identity {_short(bound.get('job_identity'))}, this job is {job_identity}"
    return None


def legacy_unbound(manifest: JSONObject) -> bool:
    """A signed manifest written before signatures carried a binding (trusted by the key alone)."""
    return isinstance(manifest.get(SIGNATURE), dict) and BINDING not in manifest


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_key(env_name: str | None, field: str = "checkpoint.signing_key_env") -> bytes | None:
    """The key from the named environment variable (on every worker), or None when signing is off."""
    if not env_name:
        return None
    value = os.environ.get(env_name, "")
    if not value:
        raise JobConfigError(
            f"{field}: the environment variable {env_name} is not set on this worker; set it "
            "on every node (the k8s flavours take it from the Secret syncpoint-signing-key), or "
            f"remove {field} to run without signed states"
        )
    key = value.encode()
    if len(key) < MIN_KEY_BYTES:
        raise JobConfigError(
            f"{field}: the key in {env_name} has {len(key)} bytes; use at least {MIN_KEY_BYTES} "
            "random bytes (e.g. `openssl rand -hex 32`)"
        )
    return key
