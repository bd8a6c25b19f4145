"""Credentials in store and tracking URLs: masked wherever a URL is shown or stored.

A store or MLflow URL may carry a password (`postgresql+psycopg://user:PASSWORD@host/db`,
`http://user:PASSWORD@mlflow:5000`). fedcli never writes it anywhere (docs/architecture.md,
"Security"): stored configs, checkpoints, `model.pt`, MLflow artifacts, reports, hints,
logs and the command lines of the processes it starts hold the URL with the password
replaced by `***` (`user:***@host`), the form SQLAlchemy's `render_as_string(hide_password=True)`
prints in store errors. The password itself travels only in memory, in the environment a
user set (`FEDCLI_STORE`, `MLFLOW_TRACKING_URI`), and over the pipe to the MLflow mirror.

Standard library only: the config layer, the engine, the CLI and the mirror all import it.
"""

from __future__ import annotations

import re

MASK = "***"

# scheme://user:password@ : the password runs to the last "@" before the host (an "@" in a
# password must be percent-encoded in a URL, but users do not always encode it)
_CREDENTIALS = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/?#@'\"]*):(?P<password>[^\s/?#'\"]*)@")


def mask_url(text: str) -> str:
    """Return `text` with the password of every URL in it replaced by `***` (`user:***@host`).

    Works on a bare URL and on any text holding URLs (a command line, an error message);
    text without a password comes back unchanged.
    """
    return _CREDENTIALS.sub(lambda m: f"{m['head']}:{MASK}@", text)


def mask_malformed(url: str) -> str:
    """`url`, a string that failed to parse as a URL, safe to show: if it holds an "@", everything
    between its "//" (or start) and its last "@" but the user name is masked (`mask_url` finds
    credentials only behind a well-formed `scheme://`; "postgresql//me:pw@host/db" would pass it)."""
    if "@" not in url:
        return url
    head, _, tail = url.rpartition("@")
    start = head.find("//") + 2 if "//" in head else 0
    user = head[start:].split(":", 1)[0] if ":" in head[start:] else ""
    return f"{head[:start]}{user + ':' if user else ''}{MASK}@{tail}"


def has_password(url: str | None) -> bool:
    """True when `url` carries a password that is not already masked."""
    if not url:
        return False
    return any(m["password"] not in ("", MASK) for m in _CREDENTIALS.finditer(url))


def is_masked(url: str | None) -> bool:
    """True when `url` is a masked URL (`user:***@host`): it was stored or shown without its password."""
    return bool(url) and any(m["password"] == MASK for m in _CREDENTIALS.finditer(url or ""))
