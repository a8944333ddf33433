"""The one rule for a worker id, shared by every component that accepts one (the indexer's
registry, `kvatlas relay`, the shared registry): judged alike everywhere, so a worker the relay
forwards is a worker every indexer registers. Pure: no I/O."""
from __future__ import annotations

from typing import Final

MAX_WORKER_ID: Final = 256
# A worker_id is a URL path segment (DELETE /workers/{id}) and a log and metric label value:
# no separators, escapes, whitespace or control characters.
BAD_ID_CHARS: Final = frozenset('/\\?#%"\'')


def worker_id_problem(worker_id: object) -> str | None:
    """Why `worker_id` is not a valid worker id, or None when it is."""
    if not isinstance(worker_id, str) or not worker_id:
        return f"invalid worker_id {worker_id!r}: a non-empty string is required"
    if len(worker_id) > MAX_WORKER_ID:
        return f"invalid worker_id of {len(worker_id)} characters: at most {MAX_WORKER_ID}"
    if not worker_id.isprintable() or any(c.isspace() or c in BAD_ID_CHARS for c in worker_id):
        return (f"invalid worker_id {worker_id!r}: printable characters only, without whitespace "
                "or any of / \\ ? # % \" '")
    return None
