"""``syncpoint submit`` and Ray token authentication (Ray >= 2.52, ``RAY_AUTH_MODE=token``).

Where the token comes from is checked in-process. What the cluster does with it is checked against a
real local head started by the test with a token of its own (own ports and temp dir, stopped by its
own process ids; no mock of Ray's server): without the token its Job API answers 401, with a wrong
one 403. ``syncpoint submit`` must send the configured token on every request it makes (submission,
status, the log websocket), turn a missing or rejected token into one paragraph (exit 2) instead of
a traceback, and never print the token.
"""

from __future__ import annotations

import os

import pytest

from syncpoint.orchestrator.submit import auth_headers, read_token
from syncpoint.policies.contracts.errors import SpecError

# ---------------------------------------------------------------- where the token comes from


def _file(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_no_token_configured_sends_no_header(no_token: str) -> None:
    assert read_token() is None
    assert auth_headers("http://127.0.0.1:8265") == {}


def test_token_sources_in_order(no_token: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    os.makedirs(os.path.join(no_token, ".ray"))
    _file(tmp_path / "home" / ".ray" / "auth_token", "from-home\n")
    assert read_token() == "from-home"  # Ray's default file, newline stripped
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", _file(tmp_path / "path-token", "from-path\n"))
    assert read_token() == "from-path"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert read_token() == "from-env"
    flag = _file(tmp_path / "flag-token", "  from-flag  \n")
    assert read_token(flag) == "from-flag"
    assert auth_headers("http://127.0.0.1:8265", flag) == {"Authorization": "Bearer from-flag"}


@pytest.mark.parametrize("content", ["", "\n\n", "two tokens\n"])
def test_an_unusable_token_file_is_one_paragraph_without_its_content(no_token: str, tmp_path, content: str) -> None:
    path = _file(tmp_path / "token", content)
    with pytest.raises(SpecError) as e:
        read_token(path)
    assert path in str(e.value) and "tokens" not in str(e.value).replace("token file", "")
    with pytest.raises(SpecError, match="cannot read"):
        read_token(str(tmp_path / "missing"))


def test_plain_http_to_a_remote_address_warns_without_the_token(no_token: str, monkeypatch, capsys) -> None:
    monkeypatch.setenv("RAY_AUTH_TOKEN", "s3cr3t-token-value")
    assert auth_headers("http://127.0.0.1:8265") == {"Authorization": "Bearer s3cr3t-token-value"}
    assert capsys.readouterr().err == ""  # a tunnel (kubectl port-forward) is local
    auth_headers("http://ray-head.example.com:8265")
    err = capsys.readouterr().err
    assert "plain http" in err and "s3cr3t" not in err
    auth_headers("https://ray-head.example.com")
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- a real head with token auth
