"""Run the demo scenario on the dev cluster and collect what happened, from Slurm and Redis."""

from __future__ import annotations

import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from slurm_plugin.config import Settings
from slurm_plugin.demo.slowdown import CpuQuota
from slurm_plugin.devcluster import DevCluster
from slurm_plugin.errors import CommandTimeoutError, DevClusterError, StragglerError
from slurm_plugin.model.records import StepRecord
from slurm_plugin.service.state import ServiceState
from slurm_plugin.slurm.parsers import expand_hostlist, parse_scontrol_record
from slurm_plugin.slurm.runner import run_command
from slurm_plugin.store import decision as decision_record
from slurm_plugin.store.telemetry_store import TelemetryStore, connect

REPO = Path(__file__).resolve().parents[2]
SLOW_NODE = "node3"


@dataclass
class DemoRun:
    """Everything one run produced."""

    policy: str
    job_id: str = ""
    started: float = 0.0
    finished: float = 0.0
    onset_ts: float | None = None
    onset_step: int | None = None
    job: dict[str, str] = field(default_factory=dict)
    records: list[StepRecord] = field(default_factory=list)
    #: The job's events (time, name) as it reported them: checkpoints, advice acted on.
    events: list[tuple[float, str]] = field(default_factory=list)
    decisions: list[dict[str, str]] = field(default_factory=list)
    #: The audit entries of the job's decisions: every state change, oldest first.
    audit: list[dict[str, str]] = field(default_factory=list)
    output: str = ""

    @property
    def total_s(self) -> float:
        """Submit to completion."""
        return self.finished - self.started


def _max_step(store: TelemetryStore, job_id: str) -> int:
    steps = [r.step for r in store.iter_steps(job_id)]
    return max(steps) if steps else -1


def run_scenario(
    settings: Settings,
    cluster: DevCluster,
    work: Path,
    *,
    policy: str,
    steps: int,
    slow_at: int,
    quota_pct: float,
    redis_db: int,
    say: Callable[[str], None] = print,
    timeout_s: float = 720.0,
    script: Path = REPO / "examples" / "ddp_train.sbatch",
    submit_args: Sequence[str] = (),
    job_env: Mapping[str, str] | None = None,
    until: Callable[[dict[str, str]], bool] | None = None,
    policy_dir: Path = REPO / "policies",
) -> DemoRun:
    """Submit the job ``script`` (the demo's DDP job by default; ``submit_args`` and
    ``job_env`` added) under ``policy`` (from ``policy_dir``, the shipped ones by default),
    slow node3 at step ``slow_at``, and wait for the end, or until ``until(job record)`` holds
    (the job is then cancelled)."""
    url = cluster.redis_url.rsplit("/", 1)[0] + f"/{redis_db}"
    redis.Redis.from_url(url).flushdb()
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o777)
    shutil.rmtree(work / "ckpt", ignore_errors=True)
    env = {
        **os.environ,
        **cluster.env(),
        "STRAGGLER_REDIS_URL": url,
        "STRAGGLER_SERVICE_POLICY_DIR": str(policy_dir),
        "STRAGGLER_SERVICE_INTERVAL_S": "1",
        "PYTHON": sys.executable,
        "CKPT_DIR": str(work / "ckpt"),
        "STEPS": str(steps),
        "PYTHONPATH": str(REPO),
        **(job_env or {}),
    }
    service, service_log = start_service(env, work / "service.log")
    cluster.up(prolog=_prolog(work, url))  # our prolog registers the job's SPANK choices
    store = TelemetryStore(connect(url))
    state = ServiceState(connect(url, decode=True))
    quota = CpuQuota(cluster.base / "run", SLOW_NODE, quota_pct)
    run = DemoRun(policy=policy, started=time.time())
    try:
        run.job_id = _submit(policy, work, env, script, submit_args)
        say(f"submitted job {run.job_id} (policy {policy}, {steps} steps, {script.name})")
        deadline = time.time() + timeout_s
        last_line = ""
        while time.time() < deadline:
            record = _show_job(run.job_id, env, say)
            if record is None:
                continue
            step = _max_step(store, run.job_id)
            if run.onset_ts is None and step >= slow_at:
                moved = quota.apply()
                run.onset_ts, run.onset_step = time.time(), step
                say(
                    f"step {step}: {SLOW_NODE} limited to {quota_pct:g}% of a CPU "
                    f"({moved} processes)"
                )
            line = _progress(record, step, state.job_decisions(run.job_id))
            if line != last_line:
                say(f"[{time.time() - run.started:5.1f}s] {line}")
                last_line = line
            if record.get("JobState") in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}:
                break
            if until is not None and until(record):
                say(f"stopping job {run.job_id}: what was awaited happened")
                break
            time.sleep(1)
        else:
            raise DevClusterError(
                f"demo job {run.job_id} did not finish in {timeout_s:g} s; the cluster:\n"
                + _cluster_view(env)
            )
        _collect(run, env, store, state, work)
        if run.job.get("JobState") not in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}:
            run_command(["scancel", run.job_id], timeout_s=15, env=env, check=False)
    finally:
        if run.job_id and not run.finished:  # interrupted: leave no job behind
            run_command(["scancel", run.job_id], timeout_s=15, env=env, check=False)
        quota.remove()
        cluster.up()
        service.kill()
        service.wait()
        service_log.close()
    return run


def start_service(env: dict[str, str], log_path: Path) -> tuple[subprocess.Popen[bytes], Any]:
    """Start ``straggler serve`` (from this checkout) with ``env``, logging to ``log_path``;
    returns the process and the open log file."""
    service_log = log_path.open("wb")
    service = subprocess.Popen(
        [sys.executable, "-m", "slurm_plugin.cli.main", "--log-level", "info", "serve"],
        env=env,
        stdout=service_log,
        stderr=service_log,
        cwd=REPO,
    )
    return service, service_log


def _progress(record: dict[str, str], step: int, decisions: list[dict[str, str]]) -> str:
    """One line of the run's progress: the job as Slurm shows it, its step, the latest
    decision."""
    latest = decisions[-1] if decisions else {}
    return (
        f"{record.get('JobState', '?'):9} "
        f"nodes={record.get('NodeList', '?'):12} restarts={record.get('Restarts')} "
        f"reason={record.get('Reason', '?')} "
        f"step={step:4d}  decision={latest.get('decision', latest.get('action', '-'))}"
        f" {latest.get('state', '')}"
    )


def _collect(
    run: DemoRun, env: dict[str, str], store: TelemetryStore, state: ServiceState, work: Path
) -> None:
    """What the finished job left: Slurm's record, its telemetry, decisions and output."""
    run.finished = time.time()
    run.job = parse_scontrol_record(
        run_command(["scontrol", "-o", "show", "job", run.job_id], timeout_s=15, env=env).stdout
    )
    run.records = list(store.iter_steps(run.job_id))
    run.events = list(store.iter_events(run.job_id))
    run.decisions = state.job_decisions(run.job_id)
    run.audit = state.audit(job_id=run.job_id)
    run.output = (work / "job.log").read_text() if (work / "job.log").exists() else ""


def _show_job(
    job_id: str, env: dict[str, str], say: Callable[[str], None]
) -> dict[str, str] | None:
    """The job as scontrol shows it; None when a busy controller did not answer in time."""
    try:
        shown = run_command(["scontrol", "-o", "show", "job", job_id], timeout_s=15, env=env)
    except CommandTimeoutError:
        say("scontrol did not answer within 15 s; asking again")
        return None
    return parse_scontrol_record(shown.stdout)


def _cluster_view(env: dict[str, str]) -> str:
    """Every job and node as Slurm shows them (what a stuck demo needs explained)."""
    views = [["squeue", "-a", "-o", "%i %T %R %N %V"], ["sinfo", "-N", "-o", "%N %T %E"]]
    out = []
    for argv in views:
        try:
            out.append(run_command(argv, timeout_s=15, env=env, check=False).stdout.strip())
        except StragglerError as exc:  # the view is for the message: never hides the timeout
            out.append(f"{argv[0]}: {exc}")
    return "\n".join(out)


def _submit(
    policy: str, work: Path, env: dict[str, str], script: Path, submit_args: Sequence[str]
) -> str:
    """Submit the job; returns its id."""
    # The policy as shipped. Six ranks share 2 cores here, so bursts of contention reach
    # ~180 % for seconds: they are reported, and never evicted (a slowdown seconds old is
    # expected to pass); node3's slowdown is evicted once it has lasted long enough.
    out = run_command(
        [
            "sbatch",
            "--parsable",
            f"--straggler-policy={policy}",
            f"--output={work / 'job.log'}",
            "--chdir",
            str(REPO),
            *submit_args,
            str(script),
        ],
        timeout_s=30,
        env=env,
    ).stdout
    return out.strip().split(";")[0]


def _prolog(work: Path, url: str) -> Path:
    """A prolog target: our prolog with this run's Redis (no GPUs or IB on a dev machine)."""
    (work / "prolog.toml").write_text(
        f'[redis]\nurl = "{url}"\n[health]\ngpu = "off"\nstate_dir = "{work / "state"}"\n'
        f'sysfs_root = "{work / "no-sysfs"}"\n'
    )
    target = work / "run-prolog"
    target.write_text(
        "#!/bin/sh\n"
        f"export STRAGGLER_CONFIG={work / 'prolog.toml'}\n"
        f"export STRAGGLER_PROLOG_BIN={Path(sys.executable).parent / 'straggler-prolog'}\n"
        f"exec {REPO / 'prolog' / 'straggler-prolog.sh'}\n"
    )
    target.chmod(0o755)
    return target


def _rate(rows: list[StepRecord], t0: float | None = None, t1: float | None = None) -> float:
    """Steps per second of rank 0's records between t0 and t1 (NaN with fewer than two)."""
    sel = [r for r in rows if (t0 is None or r.ts >= t0) and (t1 is None or r.ts <= t1)]
    if len(sel) < 2:
        return float("nan")
    return (len(sel) - 1) / max(1e-9, sel[-1].ts - sel[0].ts)


def lost_to_straggler_s(
    run: DemoRun,
    first_run: list[StepRecord],
    second_run: list[StepRecord],
    requeue_ts: float | None,
    work_lost_steps: int | None,
) -> float | None:
    """Wall time the straggler cost the job, against its own healthy pace: the slow stretch
    (onset to requeue, or to the end without one) less the time its steps take at the rate
    before the onset; then the requeue (requeue to the first step again, less the first run's
    own start-up) and the steps done twice, at the new rate."""
    pace = _rate(first_run, None, run.onset_ts)
    if run.onset_ts is None or not first_run or not math.isfinite(pace):
        return None
    end = requeue_ts if requeue_ts is not None else first_run[-1].ts
    done = sum(1 for r in first_run if run.onset_ts < r.ts <= end)
    lost = max(0.0, (end - run.onset_ts) - done / pace)
    if requeue_ts is not None and second_run:
        startup = first_run[0].ts - run.started
        lost += max(0.0, second_run[0].ts - requeue_ts - startup)
        after = _rate(second_run)
        if work_lost_steps and math.isfinite(after):
            lost += work_lost_steps / after
    return lost


#: A step is healthy again when its time is within this much of the job's before the onset.
HEALTHY_PCT = 10.0
#: ... as the median of this many steps from it on.
_HEALTHY_STEPS = 5


def onset_to_healthy_s(
    run: DemoRun, first_run: list[StepRecord], second_run: list[StepRecord]
) -> float | None:
    """Seconds from the onset to the job's first healthy step after it (rank 0's step time,
    and the median of five steps from it, within :data:`HEALTHY_PCT` of its median before the
    onset), whatever brought it back: a requeue, or the slowdown passing; None: never healthy
    again while it was watched (also when the requeued job runs slower on its new nodes)."""
    if run.onset_ts is None or run.onset_step is None:
        return None
    before = [r.step_s for r in first_run if r.ts < run.onset_ts and r.step >= 5]
    if not before:
        return None
    bar = statistics.median(before) * (1 + HEALTHY_PCT / 100)
    # The step in progress at the onset began before it: from the one after on.
    after = [r for r in first_run if r.step >= run.onset_step + 2] + second_run
    after = [r for r in after if r.ts > run.onset_ts]
    for i, record in enumerate(after):  # healthy for a while: a lucky step is not enough
        window = after[i : i + _HEALTHY_STEPS]
        if (
            record.step_s <= bar
            and len(window) == _HEALTHY_STEPS
            and statistics.median(r.step_s for r in window) <= bar
        ):
            return record.ts - run.onset_ts
    return None


#: What the summary keeps of each decision (lasted_s and lasting_p: how long the slowdown had
#: lasted when decided, and how likely it was taken to last).
_DECISION_FIELDS = (
    "id",
    "kind",
    "node",
    "decision",
    "action",
    "state",
    "reasons",
    "lasted_s",
    "lasting_p",
)


def _step(decision: dict[str, str]) -> int:
    """The step a decision was taken at (-1: none)."""
    step = decision_record.read(decision).step
    return -1 if step is None else step


def _round(value: float | None) -> float | None:
    """A figure to 0.1 s; None for none (or NaN)."""
    return None if value is None or not math.isfinite(value) else round(value, 1)


def summarize(run: DemoRun) -> dict[str, Any]:
    """The figures of one run: detection delay, onset -> requeue, step rates, work lost."""
    nodes = expand_hostlist(run.job.get("NodeList", ""))
    eviction = next((d for d in run.decisions if d.get("action") == "evict"), None)
    # The slowdown's detection is the first decision on node3 from the onset on; a flag raised
    # before it (this machine's six ranks share two cores: a rank can lag for a second) is
    # counted apart, and the test holds that it did nothing.
    onset = run.onset_step if run.onset_step is not None else math.inf
    on_node = [d for d in run.decisions if d.get("node") == SLOW_NODE]
    detection = next((d for d in on_node if _step(d) >= onset), None)
    early = [d for d in run.decisions if _step(d) < onset]
    rank0 = sorted((r for r in run.records if r.rank == 0), key=lambda r: r.ts)
    first_run = [r for r in rank0 if r.attempt == 0]
    second_run = [r for r in rank0 if r.attempt > 0]

    requeue_ts = None
    if eviction is not None and (eviction.get("held_ts") or eviction.get("updated_at")):
        requeue_ts = float(eviction.get("held_ts") or eviction["updated_at"])
    resumed = [
        int(line.split()[-1])
        for line in run.output.splitlines()
        if line.startswith("resumed from checkpoint at step")
    ]
    advised = any(d.get("action") == "advise" for d in run.decisions)
    # When the job was first advised to leave node3 (its advice's entry in the audit).
    advice_ts = min(
        (float(e["updated_at"]) for e in run.audit if e.get("action") == "advise"),
        default=None,
    )
    # The step at the hold, from what the job reported: the newest step of any rank of the
    # first run (rank 0's newest may be a flush behind), never fewer steps lost than none;
    # after advice (no new attempt), the newest step until node3's last record.
    left_ts = max((r.ts for r in run.records if r.node == SLOW_NODE), default=math.inf)
    last_before = max(
        (r.step for r in run.records if r.attempt == 0 and (not advised or r.ts <= left_ts)),
        default=None,
    )
    work_lost = (
        max(0, last_before + 1 - resumed[-1]) if resumed and last_before is not None else None
    )
    lost = lost_to_straggler_s(run, first_run, second_run, requeue_ts, work_lost)
    healthy = onset_to_healthy_s(run, first_run, second_run)
    ranks = len({r.rank for r in run.records})
    return {
        "policy": run.policy,
        # How node3 left: a requeue, or the job itself on advice (no requeue).
        "recovery": "advice" if advised else "requeue",
        "job_id": run.job_id,
        "state": run.job.get("JobState"),
        "restarts": int(run.job.get("Restarts", "0") or 0),
        "final_nodes": nodes,
        "excluded": run.job.get("ExcNodeList") if run.job.get("ExcNodeList") != "(null)" else None,
        "total_s": round(run.total_s, 1),
        "onset_step": run.onset_step,
        "detection_step": int(detection["step"]) if detection else None,
        "alarms_before_onset": len(early),
        # What changed the job or a node: an annotation is only a note, "none" not even that.
        "actions_before_onset": sorted({d.get("action", "") for d in early} - {"annotate", "none"}),
        "detection_delay_steps": (
            int(detection["step"]) - run.onset_step
            if detection and run.onset_step is not None
            else None
        ),
        "detection_delay_s": (
            round(float(detection["detected_ts"]) - run.onset_ts, 1)
            if detection and run.onset_ts
            else None
        ),
        "onset_to_requeue_s": (
            round(requeue_ts - run.onset_ts, 1) if requeue_ts and run.onset_ts else None
        ),
        "onset_to_advice_s": (
            round(advice_ts - run.onset_ts, 1) if advice_ts and run.onset_ts else None
        ),
        "steps_per_s_before": round(_rate(first_run, None, run.onset_ts), 2),
        "steps_per_s_during": round(_rate(first_run, run.onset_ts, None), 2),
        "steps_per_s_after": round(_rate(second_run), 2),
        "onset_to_healthy_s": _round(healthy),
        # From the requeue (or the advice) to that step: what the recovery itself took.
        "action_to_healthy_s": _round(
            healthy - (requeue_ts or advice_ts or math.nan) + (run.onset_ts or math.nan)
            if healthy is not None
            else None
        ),
        "resumed_from_step": resumed[-1] if resumed else None,
        "work_lost_steps": work_lost,
        "ranks": ranks,
        "lost_to_straggler_s": round(lost, 1) if lost is not None else None,
        "rank_hours_lost": round(lost * ranks / 3600, 4) if lost is not None else None,
        "decisions": [{k: d.get(k) for k in _DECISION_FIELDS} for d in run.decisions],
    }
