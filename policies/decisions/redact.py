"""Keep credentials out of everything syncpoint prints, logs or hands to another process.

Why a leaf module (nothing of the project imported): every layer — the CLI, the Ray launcher, the
job submitter, the spec's own error messages — must be able to redact without dragging in
torch, Ray or pydantic, and the rules must be the same everywhere.

What counts as a secret here: the user-info of a URL (``s3://KEY:SECRET@bucket``,
``https://user:pass@host``), the values of query parameters whose names say they carry one
(``?token=...``, ``X-Amz-Signature=...``, ``sig=...``), and by the same rule the values of
environment variables whose names do (``scaling.env``: ``WANDB_API_KEY``, ``HF_TOKEN``).
Redaction errs towards hiding too much: a display that shows ``***`` where a harmless string was
is a small loss; a printed key is not.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

MASK = "***"

# scheme://rest — the scheme as RFC 3986 spells it; `rest` stops at whitespace and quoting
# characters so a URL embedded in an error message or a repr() is found with its boundaries.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]*")
# query parameter names that carry a credential (presigned S3/GCS URLs, Azure SAS, API tokens)
_SECRET_PARAM = re.compile(r"token|sig|secret|pass|pwd|key|credential|auth", re.I)


def _userinfo_end(rest: str) -> int:
    """Index just past the ``@`` that ends the user-info in ``rest`` (the URL after ``://``), or -1.

    The authority normally ends at the first ``/``; but an S3 secret key often contains ``/`` and
    users rarely percent-encode it (``s3://AKIA:ab/cd@bucket``). So when the first segment looks
    like ``user:secret`` (a colon not followed by a numeric port) and an ``@`` comes later, the
    user-info is taken to run to the last ``@`` before any query or fragment.
    """
    stop = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    head = rest[:stop]
    slash = head.find("/")
    authority = head if slash < 0 else head[:slash]
    if "@" in authority:
        return authority.rfind("@") + 1
    user, colon, after = authority.partition(":")
    if colon and not after.isdigit() and "@" in head:
        return head.rfind("@") + 1
    return -1


def _redact_query(query: str) -> str:
    """``a=1&token=x`` -> ``a=1&token=***``: values of credential-named parameters only."""
    parts = []
    for item in query.split("&"):
        name, eq, value = item.partition("=")
        parts.append(f"{name}={MASK}" if eq and value and _SECRET_PARAM.search(name) else item)
    return "&".join(parts)


def redact_url(url: str) -> str:
    """``url`` with its user-info and credential-bearing query values replaced by ``***``.

    A string that is not a URL (a local path, a name) comes back unchanged, so callers can pass
    anything that might be one.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*", scheme):
        return url
    end = _userinfo_end(rest)
    if end > 0:
        rest = f"{MASK}@" + rest[end:]
    before, q, query = rest.partition("?")
    if q:
        fragment_at = query.find("#")
        tail = "" if fragment_at < 0 else query[fragment_at:]
        rest = before + "?" + _redact_query(query if fragment_at < 0 else query[:fragment_at]) + tail
    return f"{scheme}://{rest}"


def url_secrets(url: str) -> list[str]:
    """The literal secret strings inside ``url`` (its user-info, raw and percent-decoded).

    Why: an error raised by a storage backend may quote a password without the URL around it;
    these are the strings ``redact_text`` also hides.
    """
    scheme, sep, rest = url.partition("://")
    end = _userinfo_end(rest) if sep else -1
    if end <= 0:
        return []
    info = rest[: end - 1]
    user, _, password = info.partition(":")
    found = {info, unquote(info)}
    if len(password) >= 4:  # shorter strings would mask unrelated words
        found |= {password, unquote(password)}
    # a backend that misparses the URL quotes pieces of it (s3fs: bucket 'KEY:SECRET-UP-TO-A-SLASH')
    for text in (info, unquote(info)):
        found |= {piece for piece in re.split(r"[:/@]", text) if len(piece) >= 6}
        found |= {text[:i] for i in range(len(text)) if text[i] == "/" and i >= 6}
    return sorted((s for s in found if s), key=len, reverse=True)


def redact_text(text: str, *urls: str) -> str:
    """Every URL inside ``text`` redacted, and the secrets of ``urls`` masked wherever they appear."""
    for url in urls:
        for secret in url_secrets(url):
            text = text.replace(secret, MASK)
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


def redact_obj(obj: Any) -> Any:
    """A copy of a JSON-like structure with every string passed through ``redact_text``."""
    if isinstance(obj, str):
        return redact_text(obj)
    if isinstance(obj, dict):
        return {k: redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_obj(v) for v in obj)
    return obj


def secret_name(name: str) -> bool:
    """Whether a variable or parameter name says its value is a credential (``WANDB_API_KEY``,
    ``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ``DB_PASSWORD``): the query-parameter rule, erring
    towards hiding (``AWS_ACCESS_KEY_ID`` and ``RAY_AUTH_MODE`` are masked too)."""
    return bool(_SECRET_PARAM.search(name))


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """Environment variables for display: the value of every ``secret_name`` masked, the others
    through ``redact_text`` (a URL value's credentials)."""
    return {k: MASK if secret_name(k) else redact_text(v) for k, v in env.items()}


def has_url_secrets(obj: Any) -> bool:
    """Whether any string in a JSON-like structure holds a URL credential ``redact_obj`` would hide."""
    return redact_obj(obj) != obj


def url_secret_paths(obj: Any, path: str = "") -> list[str]:
    """Dotted paths (``storage``, ``task.config.src``) of the strings in ``obj`` that hold URL credentials."""
    if isinstance(obj, str):
        return [path or "(value)"] if redact_text(obj) != obj else []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return [p for k, v in items for p in url_secret_paths(v, f"{path}.{k}" if path else str(k))]
