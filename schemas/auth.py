"""The bearer token rule every kvatlas process shares (the indexer, the proxy, the worker): one home,
low in the import graph, so a worker or a router need not import the indexer's command to read it."""
from __future__ import annotations


def read_token(flag: str | None, path: str | None, env: str | None) -> str | None:
    """The bearer token: `--auth-token`, else the file's first line, else $KVATLAS_AUTH_TOKEN.
    An empty or unreadable file is a configuration error, never a silent "no auth"."""
    if flag:
        return flag
    if path:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
        if not token:
            raise ValueError(f"auth token file {path} is empty")
        return token
    return env or None
