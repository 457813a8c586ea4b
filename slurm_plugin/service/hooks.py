"""The site's node hooks (``[hooks]``), run by the leading service: when a node becomes a
persistent straggler or is forgiven, the site's command gets the turn as JSON on standard
input (a cloud's "report host faulty", a health check, a ticket).

One hook runs at a time, on a thread of its own: a cycle only starts the next one and never
waits for it. The command is an argv list (never a shell), started in a session of its own
with a small environment (no Redis URL, no password); one still running after ``timeout_s`` is
killed with its whole process group. Each run is an audit record (``action = "hook"``:
``done`` or ``failed``, the exit status or why, the seconds, the output's tail; ``of`` the
decision that turned the node). Requests come from the queue in Redis (``store/hooks.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

import redis
import structlog

from slurm_plugin.config.tables import HookSettings
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm import marks
from slurm_plugin.store import hooks

log = structlog.get_logger(__name__)
#: What of a hook's output the audit keeps (its end).
_TAIL = 400
#: After a kill, how long to wait for the pipes a hook's escaped descendants may hold.
_DRAIN_S = 5.0


@dataclass(frozen=True)
class Outcome:
    """How one run of a hook ended."""

    ok: bool
    seconds: float
    #: The exit status; None: it did not start, or was killed at the time limit.
    status: int | None
    output: str
    error: str | None = None


def run_hook(argv: list[str], stdin: str, timeout_s: float) -> Outcome:
    """Run ``argv`` with ``stdin`` on its standard input, its output (stdout and stderr)
    kept; killed with its process group after ``timeout_s``. Never raises."""
    started = time.monotonic()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            env=env,
            cwd="/",
        )
    except OSError as exc:
        return Outcome(False, 0.0, None, "", f"cannot run {argv[0]}: {exc.strerror or exc}")
    try:
        out, _ = proc.communicate(stdin.encode(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, _ = proc.communicate(timeout=_DRAIN_S)
        except subprocess.TimeoutExpired:  # a descendant left the group and holds the pipe
            proc.kill()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
            proc.wait()
            out = b""
        tail = _tail(out)
        return Outcome(
            False, time.monotonic() - started, None, tail, f"timed out after {timeout_s:g} s"
        )
    seconds = time.monotonic() - started
    status = proc.returncode
    if status == 0:
        return Outcome(True, seconds, 0, _tail(out))
    why = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
    return Outcome(False, seconds, status, _tail(out), why)


def _tail(out: bytes) -> str:
    text = out.decode("utf-8", "replace").strip()
    return text[-_TAIL:]


class NodeHooks:
    """Runs the queued node hooks for the leading service, one at a time."""

    def __init__(
        self,
        settings: HookSettings,
        state: ServiceState,
        deployment: str,
        *,
        dry_run: bool = False,
    ) -> None:
        self.settings = settings
        self.state = state
        self.deployment = deployment
        self.dry_run = dry_run
        self._thread: threading.Thread | None = None
        self._recovered = False

    @property
    def busy(self) -> bool:
        """A hook is running now."""
        return self._thread is not None and self._thread.is_alive()

    def tick(self) -> None:
        """Start the next waiting hook when none runs (each leading cycle); never waits for
        one. The first call puts back what a stopped service left running."""
        client = self.state.client
        if not self._recovered:
            moved = hooks.requeue_running(client)
            self._recovered = True
            if moved:
                log.warning("service.hooks_requeued", requests=moved)
        if self.busy:
            return
        taken = hooks.take(client)
        if taken is None:
            return
        raw, request = taken
        if request is None:
            log.warning("service.hook_request_unreadable", raw=raw[:200])
            hooks.finish(client, raw)
            return
        persistent = request.kind == hooks.PERSISTENT  # else FORGIVEN (decode checks)
        argv = self.settings.on_persistent if persistent else self.settings.on_forgiven
        if not argv:  # no hook for this turn: nothing to run, nothing to record
            hooks.finish(client, raw)
            return
        if self.dry_run:
            self._record(request, "skipped", note="dry run: not run")
            hooks.finish(client, raw)
            return
        self._thread = threading.Thread(
            target=self._run, args=(raw, request, list(argv)), name="node-hook", daemon=True
        )
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the hook running now (tests; a stopping service)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self, raw: str, request: hooks.HookRequest, argv: list[str]) -> None:
        payload = json.dumps(request.payload(self.deployment), allow_nan=False)
        outcome = run_hook(argv, payload, self.settings.timeout_s)
        log_fn = log.info if outcome.ok else log.error
        log_fn(
            "service.hook_ran",
            kind=request.kind,
            node=request.node,
            of=request.decision_id,
            ok=outcome.ok,
            seconds=round(outcome.seconds, 2),
            error=outcome.error,
        )
        try:
            self._record(
                request,
                "done" if outcome.ok else "failed",
                note=outcome.output or None,
                error=outcome.error,
                seconds=round(outcome.seconds, 3),
            )
            hooks.finish(self.state.client, raw)
        except redis.RedisError as exc:  # stays on the running list: run again after a restart
            log.error("service.hook_unrecorded", node=request.node, error=str(exc))  # noqa: TRY400

    def _record(self, request: hooks.HookRequest, outcome: str, **fields: object) -> None:
        self.state.save_decision(
            marks.new_decision_id(),
            {
                "state": outcome,
                "action": "hook",
                "kind": request.kind,
                "node": request.node,
                "of": request.decision_id,
                **{k: v for k, v in fields.items() if v is not None},
            },
        )
