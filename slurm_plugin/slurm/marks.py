"""Our marks on the cluster: every drain reason and job comment carries our prefix and the
decision id, so we only ever undo what we did."""

from __future__ import annotations

import re
import secrets

PREFIX = "straggler:"
_ID = re.compile(r"\[(d-[0-9a-f]{12})\]")
_UNSAFE = re.compile(r"[^A-Za-z0-9 ._%+:/=,@-]")
MAX_REASON = 200


def new_decision_id() -> str:
    """A fresh decision id (``d-`` and 12 hex digits)."""
    return f"d-{secrets.token_hex(6)}"


def clean(text: str, limit: int = 120) -> str:
    """Text safe inside a Slurm reason or comment: no quotes, brackets, newlines or shell
    metacharacters (values reach Slurm as one argv element, but tools parse them back)."""
    return _UNSAFE.sub("_", text)[:limit]


def reason(cause: str, evidence: str, decision_id: str) -> str:
    """``straggler: <cause> <evidence> [<decision id>]``."""
    text = f"{PREFIX} {clean(cause, 40)} {clean(evidence)} [{decision_id}]"
    return text[:MAX_REASON]


def decision_of(text: str) -> str | None:
    """The decision id in one of our marks, or None when the text is not ours."""
    if not text.startswith(PREFIX):
        return None
    match = _ID.search(text)
    return match.group(1) if match else None


def is_ours(text: str) -> bool:
    """True for a mark we made (prefix and a decision id)."""
    return decision_of(text) is not None
