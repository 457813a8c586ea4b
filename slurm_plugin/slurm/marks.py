"""Our marks on the cluster: every drain reason and job comment carries our prefix and the
decision id, so we only ever undo what we did."""

from __future__ import annotations

import re
import secrets

PREFIX = "straggler:"
#: ``[d-<12 hex>@<deployment>]``; marks made before deployments had ids lack ``@...``.
_ID = re.compile(r"\[(d-[0-9a-f]{12})(?:@([a-z0-9-]{1,16}))?\]")
DEPLOYMENT = re.compile(r"^[a-z0-9-]{1,16}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9 ._%+:/=,@-]")
MAX_REASON = 200


def new_decision_id() -> str:
    """A fresh decision id (``d-`` and 12 hex digits)."""
    return f"d-{secrets.token_hex(6)}"


def clean(text: str, limit: int = 120) -> str:
    """Text safe inside a Slurm reason or comment: no quotes, brackets, newlines or shell
    metacharacters (values reach Slurm as one argv element, but tools parse them back)."""
    return _UNSAFE.sub("_", text)[:limit]


def tag(decision_id: str, deployment: str = "") -> str:
    """``[<decision id>@<deployment>]``: which decision of which deployment made a mark."""
    return f"[{decision_id}@{deployment}]" if deployment else f"[{decision_id}]"


def reason(cause: str, evidence: str, decision_id: str, deployment: str = "") -> str:
    """``straggler: <cause> <evidence> [<decision id>@<deployment>]`` (the tag is kept whole
    however long the evidence)."""
    mark = tag(decision_id, deployment)
    text = f"{PREFIX} {clean(cause, 40)} {clean(evidence)}"
    return f"{text[: MAX_REASON - len(mark) - 1]} {mark}"


def decision_of(text: str, deployment: str | None = None) -> str | None:
    """The decision id in one of our marks, or None when the text is not ours. With
    ``deployment``: only a mark of that deployment (or one made before marks named theirs)
    counts; another deployment sharing this Slurm made the rest, and they are never undone."""
    if not text.startswith(PREFIX):
        return None
    match = _ID.search(text)
    if match is None:
        return None
    if deployment is not None and match.group(2) not in {None, deployment}:
        return None
    return match.group(1)


def eviction_of(comment: str, deployment: str | None = None) -> tuple[str, bool] | None:
    """Our eviction mark in a job's AdminComment (the last part, after anyone else's text and
    " | "): its decision id, and whether the job was released since (the mark reads
    "evicted"); None when the comment holds no eviction mark (of ``deployment``)."""
    mark = comment.rsplit(" | ", 1)[-1]
    ours = decision_of(mark, deployment)
    if ours is None:
        return None
    if " evict [" in mark:
        return ours, False
    return (ours, True) if " evicted [" in mark else None


def is_ours(text: str, deployment: str | None = None) -> bool:
    """True for a mark we made (prefix and a decision id; of ``deployment`` when given)."""
    return decision_of(text, deployment) is not None
