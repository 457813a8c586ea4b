#!/usr/bin/env python3
"""An example node hook for slurm-straggler's ``[hooks]`` (docs/deploy.md, "Node hooks").

The service runs it when a node becomes a persistent straggler or is forgiven, with the event
as JSON on standard input. This one files a "ticket" per event in a spool directory, one file
named for the decision id (a hook may be run twice for one event, after a service restart:
the decision id makes it idempotent), and says what it did on standard output (the service
keeps the output's tail in the audit). Replace the filing with your site's call: a cloud's
"report host faulty", a health-check run, a ticket system.

    [hooks]
    on_persistent = ["/opt/slurm-straggler/contrib/hooks/node-hook.py", "/var/spool/straggler"]
    on_forgiven = ["/opt/slurm-straggler/contrib/hooks/node-hook.py", "/var/spool/straggler"]

Exit 0: done; any other status: recorded as failed (the service does not retry it).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def say(text: str) -> None:
    sys.stdout.write(text + "\n")


def main() -> int:
    if len(sys.argv) != 2:
        say("usage: node-hook.py SPOOL_DIR  (the event as JSON on standard input)")
        return 2
    spool = Path(sys.argv[1])
    event = json.load(sys.stdin)
    if event.get("version") != 1:
        say(f"unknown event version {event.get('version')!r}")
        return 2
    decision = str(event["decision_id"])
    if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", decision):
        say(f"unexpected decision id {decision[:64]!r}")
        return 2
    ticket = spool / f"{decision}.json"
    if ticket.exists():
        say(f"{ticket.name}: filed before")
        return 0
    spool.mkdir(parents=True, exist_ok=True)
    slow = [i["slowdown_pct"] for i in event.get("incidents", []) if i.get("slowdown_pct")]
    summary = {
        "node": event["node"],
        "what": event["event"],
        "by": event["by"],
        "why": event.get("reasons", []),
        "jobs": sorted({i["job"] for i in event.get("incidents", [])}),
        "worst_slowdown_pct": max(slow, default=None),
    }
    partial = ticket.with_suffix(".tmp")
    partial.write_text(json.dumps(summary, indent=2) + "\n")
    partial.replace(ticket)  # whole or not at all
    say(f"{ticket.name}: {event['event']} {event['node']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
