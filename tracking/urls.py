"""Credentials in store and tracking URLs: masked wherever a URL is shown or stored.

A store or MLflow URL may carry a password (`postgresql+psycopg://user:PASSWORD@host/db`,
`postgresql+psycopg://user@host/db?password=PASSWORD`, `http://user:PASSWORD@mlflow:5000`).
fedcli never writes it anywhere (docs/operations.md, "Security"): stored configs,
checkpoints, `model.pt`, MLflow artifacts, reports, hints, logs and the command lines of the
processes it starts hold the URL with the password replaced by `***` (`user:***@host`,
`?password=***`). The password itself travels only in memory, in the environment a user set
(`FEDCLI_STORE`, `MLFLOW_TRACKING_URI`), and over the pipes to the MLflow mirror and the sweep
workers.

`mask_url` is the one masking function: a URL is parsed with SQLAlchemy's `make_url` and shown
with `render_as_string(hide_password=True)`, password-like query parameters (`password`, `pwd`,
`sslpassword`, ... any case) masked too; a string that does not parse is masked from the user
name to its last `@`. SQLAlchemy is imported only for text that may hold a credential (an `@`
or a password-like parameter), so the mirror and the CLI's fast paths stay standard-library only.

`sqlite_path` is the one reader of a SQLite URL's database file (the store's, MLflow's).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

MASK = "***"
_MASKS = (MASK, "%2A%2A%2A", "%2a%2a%2a")

# query parameters (and `key=value` text) whose value is a credential, any case
_SECRET_KEYS = (
    "password",
    "passwd",
    "pwd",
    "pass",
    "sslpassword",
    "secret",
    "token",
    "access_token",
    "auth_token",
    "api_key",
    "apikey",
)
_SECRET_PARAM = re.compile(
    r"(?i)(?<![A-Za-z0-9_])(?P<key>" + "|".join(_SECRET_KEYS) + r")=(?P<value>[^\s&]*)"
)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
_TOKEN = re.compile(r"\S+")
_TRAILING = (
    "'\")],;`"  # quotes and punctuation around a URL in text (a URL's host or path never ends with them)
)


def _is_secret_key(key: str) -> bool:
    return key.lower() in _SECRET_KEYS


def _mask_params(text: str) -> str:
    """`key=value` pairs of password-like keys with the value masked (a closing quote or bracket kept)."""

    def masked(m: re.Match[str]) -> str:
        value = m["value"]
        return f"{m['key']}={MASK}{value[len(value.rstrip(_TRAILING)) :]}"

    return _SECRET_PARAM.sub(masked, text)


def _mask_raw(url: str) -> str:
    """A string that is not a well-formed URL: everything between the user name (after "//", or the start)
    and the last "@" is masked, and password-like parameters (first: their value may hold an "@")."""
    url = _mask_params(url)
    if "@" in url:
        head, _, tail = url.rpartition("@")
        start = head.find("//") + 2 if "//" in head else 0
        if ":" in head[start:]:
            url = f"{head[:start]}{head[start:].split(':', 1)[0]}:{MASK}@{tail}"
    return url


def _query_text(query: Any) -> str:
    parts = []
    for key, values in query.items():
        for value in values if isinstance(values, tuple) else (values,):
            shown = MASK if _is_secret_key(key) and value else quote(value, safe="/:,")
            parts.append(f"{quote(key, safe='')}={shown}")
    return "&".join(parts)


def _mask_one(url: str) -> str:
    """One URL (no surrounding text) with its password and password-like query parameters masked;
    returned unchanged when it holds none."""
    from sqlalchemy.engine.url import make_url

    url = _mask_params(
        url
    )  # first: a value not percent-encoded may hold "@", "/", "#" that the parser would split
    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 - ArgumentError, ValueError (a port that is not a number), ...: not a URL
        return _mask_raw(url)
    if parsed.get_backend_name() == "sqlite":  # a file path: an "@" or ":" in it is no credential
        return _mask_params(url)
    if "@" in (parsed.host or "") or "@" in (parsed.database or ""):
        return _mask_raw(
            url
        )  # an "@" of the password not percent-encoded: SQLAlchemy split it at the first one
    secret_query = any(
        _is_secret_key(k) and any(v not in ("", *_MASKS) for v in (vs if isinstance(vs, tuple) else (vs,)))
        for k, vs in parsed.query.items()
    )
    if parsed.password in (None, "", MASK) and not secret_query:
        return url
    shown = parsed.set(query={}).render_as_string(hide_password=True)
    query = _query_text(parsed.query)
    return f"{shown}?{query}" if query else shown


def _mask_token(token: str) -> str:
    """A whitespace-free piece of text: each URL in it masked (from its scheme to the next one)."""
    starts = [m.start() for m in _SCHEME.finditer(token)]
    if not starts:
        return _mask_raw(token) if re.search(r"//\S*:\S*@", token) else _mask_params(token)
    out = [_mask_params(token[: starts[0]])]
    for start, end in zip(starts, [*starts[1:], len(token)], strict=True):
        piece = token[start:end]
        core = piece.rstrip(_TRAILING)
        out.append(_mask_one(core) + piece[len(core) :])
    return "".join(out)


def mask_url(text: str) -> str:
    """Return `text` with the password of every URL in it replaced by `***` (`user:***@host`,
    `?password=***`).

    Works on a bare URL (a malformed one too: masked from its user name to its last `@`) and on
    any text holding URLs (a command line, an error message, a summary); text without a password
    comes back unchanged, SQLite paths included.
    """
    if not text or ("@" not in text and _SECRET_PARAM.search(text) is None):  # no credential to mask
        return text
    if not any(c.isspace() for c in text):
        return _mask_token(text) if _SCHEME.search(text) else _mask_one(text)
    return _TOKEN.sub(lambda m: _mask_token(m[0]), text)


def has_password(url: str | None) -> bool:
    """True when `url` (or text holding URLs) carries a password that is not already masked."""
    return bool(url) and mask_url(url or "") != url


def is_masked(url: str | None) -> bool:
    """True when `url` is a masked URL (`user:***@host`, `?password=***`): it was stored or shown without
    its password."""
    if not url:
        return False
    if any(f":{mask}@" in url for mask in _MASKS):
        return True
    return any(m["value"].rstrip(_TRAILING) in _MASKS for m in _SECRET_PARAM.finditer(url))


def connect_url(store: Any) -> str:
    """The URL to connect to an open `SqlStore`'s database with, password included (`store.url` is the one
    shown, masked): for Optuna's storage of a search's study (fedcli/sweep/search.py, the report's search
    section). Kept in memory and passed over the sweep workers' pipes, never written nor put on a command
    line (docs/operations.md, "Security")."""
    return str(store._engine.url.render_as_string(hide_password=False))


def sqlite_path(url: Any) -> Path | None:
    """The database file of a SQLite URL (a string or a SQLAlchemy `URL`), `~` expanded, relative as
    given: `sqlite:///runs/fedcli.db` -> runs/fedcli.db, `sqlite:////abs/fedcli.db` -> /abs/fedcli.db.

    None for any other database, for in-memory SQLite (`sqlite://`, `sqlite:///:memory:`), for a
    `file:` URI database (`?uri=true`) and for a string that does not parse as a URL.
    """
    if isinstance(url, str):
        if not url.startswith("sqlite"):
            return None
        from sqlalchemy.engine.url import make_url

        try:
            url = make_url(url)
        except Exception:  # noqa: BLE001 - ArgumentError, ValueError (a port that is not a number): no URL
            return None
    if url.get_backend_name() != "sqlite":
        return None
    database = url.database
    if not database or database == ":memory:" or url.query.get("uri") or database.startswith("file:"):
        return None
    return Path(database).expanduser()
