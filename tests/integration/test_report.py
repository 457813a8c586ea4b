"""The demo report as an admin sees it: rendered by headless Chromium (a screenshot is taken and
must show the page), no horizontal overflow at desktop and laptop widths, figures in words,
JSON only inside the collapsible detail, and a job's text escaped."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from slurm_plugin.demo.report import render, write_report
from slurm_plugin.demo.run import DemoRun, summarize
from slurm_plugin.model.records import StepRecord

pytest.importorskip("matplotlib", reason="the demo extra is installed by `make install`")
HOSTILE = "<script>document.title='pwned'</script>"
T0 = 1_000_000.0


def _records(
    attempt: int, steps: range, t_start: float, nodes: dict[int, str], slow_from: int
) -> list[StepRecord]:
    out = []
    slowed = "node3" in nodes.values()
    ts = t_start
    for step in steps:
        took = 0.5 if slowed and step >= slow_from else 0.1  # the straggler sets the pace
        ts += took
        for rank, node in nodes.items():
            slow = node == "node3" and step >= slow_from
            compute = 0.05 * (10 if slow else 1) * (1 + 0.05 * ((rank * 7 + step) % 5))
            out.append(
                StepRecord("7", rank, node, rank % 2, step, ts, took, compute, 0.02, None, attempt)
            )
    return out


def _runs() -> list[tuple[DemoRun, dict[str, object]]]:
    first = {0: "node1", 1: "node1", 2: "node2", 3: "node2", 4: "node3", 5: "node3"}
    second = {**first, 4: "node4", 5: "node4"}
    evicted = DemoRun(policy="evict", job_id="7", started=T0, finished=T0 + 36)
    evicted.onset_ts, evicted.onset_step = T0 + 11.0, 60
    evicted.records = _records(0, range(80), T0 + 5, first, 60) + _records(
        1, range(80, 200), T0 + 22, second, 10_000
    )
    reasons = json.dumps(["node3 computes 900% longer than its peers", HOSTILE])
    evicted.decisions = [
        {
            "id": "d-1a2b",
            "node": "node3",
            "decision": "evict",
            "action": "evict",
            "state": "verified",
            "reasons": reasons,
            "detected_ts": str(T0 + 11.5),
            "held_ts": str(T0 + 13.0),
            "step": "64",
        }
    ]
    changes = [("waiting", 11.5), ("held", 13.0), ("excluded", 13.2), ("released", 13.4)]
    evicted.audit = [
        {"id": "d-1a2b", "state": s, "updated_at": str(T0 + t)}
        for s, t in [*changes, ("verified", 22.5)]
    ]
    evicted.job = {
        "JobState": "COMPLETED",
        "Restarts": "1",
        "NodeList": "node[1-2,4]",
        "ExcNodeList": "node3",
    }
    evicted.output = "resumed from checkpoint at step 80\n"
    observed = DemoRun(policy="observe", job_id="8", started=T0, finished=T0 + 82)
    observed.onset_ts, observed.onset_step = T0 + 11.0, 60
    observed.records = _records(0, range(200), T0 + 5, first, 60)
    observed.decisions = [
        {
            "id": "d-3c4d",
            "node": "node3",
            "decision": "report",
            "action": "report",
            "state": "recorded",
            "reasons": reasons,
            "detected_ts": str(T0 + 11.5),
            "step": "64",
        }
    ]
    observed.audit = [{"id": "d-3c4d", "state": "recorded", "updated_at": str(T0 + 11.6)}]
    observed.job = {"JobState": "COMPLETED", "Restarts": "0", "NodeList": "node[1-3]"}
    return [(evicted, summarize(evicted)), (observed, summarize(observed))]


def test_the_report_says_it_in_words() -> None:
    """Headline with time and rank-hours; no None, NaN or JSON quoting outside the detail;
    reasons as sentences; a job's text escaped."""
    page = render(_runs())
    outside = re.sub(r"<details>.*?</details>", "", page, flags=re.S)
    outside = re.sub(r"<svg.*?</svg>", "", outside, flags=re.S)
    headline = re.search(r'<p class="headline" id="headline">(.*?)</p>', page, re.S)
    assert headline is not None
    assert "Evicting node3 finished the job in 36 s instead of 82 s (56% less time)" in (
        headline.group(1)
    )
    assert "rank-hours saved" in headline.group(1)
    for bad in ("None", "NaN", "null", '"evict"', "(null)"):
        assert bad not in outside, bad
    assert "<li>node3 computes 900% longer than its peers</li>" in page
    assert HOSTILE not in page
    assert "&lt;script&gt;" in page
    assert page.count("<svg") == 4  # a heatmap and a timeline per run


def test_the_figures_count_from_what_the_job_reported() -> None:
    """Issue 40 item 4: the step at the hold is the newest any rank reported (rank 0's last
    flush may lag: the demo once printed ``work_lost_steps -1``), never fewer than none lost;
    onset to the first healthy step: the requeued run's first step as fast as before."""
    (evicted, summary), (_, observed) = _runs()
    assert summary["work_lost_steps"] == 0
    assert summary["onset_to_healthy_s"] == pytest.approx(11.1)  # 22.1 s - the onset at 11
    assert observed["onset_to_healthy_s"] is None  # slow until the end
    lagging = [r for r in evicted.records if not (r.rank == 0 and r.attempt == 0 and r.step > 76)]
    evicted.records = lagging
    assert summarize(evicted)["work_lost_steps"] == 0  # rank 0 at 76, the others at 79
    evicted.output = "resumed from checkpoint at step 70\n"
    assert summarize(evicted)["work_lost_steps"] == 10  # 70..79 done twice


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium is missing: `make test` installs it (apt-get install chromium)")
    return found


def _chrome(tmp_path: Path, *args: str) -> str:
    done = subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.parametrize("width", [1280, 800])
def test_the_report_renders_in_chromium_without_overflow(tmp_path: Path, width: int) -> None:
    """Chromium lays the page out at ``width`` px: nothing is wider than the window, both
    figures of each run are drawn, and a screenshot shows a page that is not blank."""
    from PIL import Image  # noqa: PLC0415 - pillow comes with matplotlib (the demo extra)

    report = tmp_path / "report.html"
    write_report(report, _runs())
    probe = tmp_path / "probe.html"
    measure = (
        "<script>window.addEventListener('load', () => { const d = document.documentElement;"
        " const svgs = [...document.querySelectorAll('svg')];"
        " document.title = JSON.stringify({scroll: d.scrollWidth, client: d.clientWidth,"
        " svgs: svgs.length, drawn: svgs.filter(s => s.getBoundingClientRect().width > 100)"
        ".length, widest: Math.max(...svgs.map(s => s.getBoundingClientRect().right))}); });"
        "</script>"
    )
    probe.write_text(report.read_text().replace("</body>", measure + "</body>"))
    dom = _chrome(
        tmp_path,
        f"--window-size={width},2000",
        "--virtual-time-budget=5000",
        "--dump-dom",
        probe.as_uri(),
    )
    title = re.search(r"<title>(.*?)</title>", dom, re.S)
    assert title is not None, dom[:500]
    layout = json.loads(title.group(1))
    assert layout["scroll"] <= layout["client"], layout
    assert layout["widest"] <= layout["client"], layout
    assert layout["svgs"] == layout["drawn"] == 4, layout
    shot = tmp_path / "report.png"
    _chrome(tmp_path, f"--window-size={width},2400", f"--screenshot={shot}", report.as_uri())
    with Image.open(shot) as image:
        assert image.size == (width, 2400)
        colours = image.convert("RGB").getcolors(maxcolors=1_000_000) or []
    assert len(colours) > 200, "the screenshot is (nearly) blank"


def test_an_advised_run_counts_from_the_advice() -> None:
    """Issue 40 item 4, advice: no new attempt, so the work done twice is counted up to the
    step at which node3 left, and the recovery from the advice (its audit entry) to the first
    healthy step of the group without node3."""
    first = {0: "node1", 1: "node2", 2: "node3", 3: "node4"}
    regrouped = {0: "node1", 1: "node2", 2: "node4"}
    run = DemoRun(policy="evict", job_id="9", started=T0, finished=T0 + 60)
    run.onset_ts, run.onset_step = T0 + 11.0, 60
    before = _records(0, range(86), T0 + 5, first, 60)  # node3 leaves after step 85
    run.records = before + _records(0, range(80, 200), T0 + 30, regrouped, 10_000)
    run.decisions = [
        {
            "id": "d-5e6f",
            "node": "node3",
            "action": "advise",
            "state": "acted",
            "step": "70",
            "detected_ts": str(T0 + 18.0),
        }
    ]
    run.audit = [
        {"id": "d-5e6f", "action": "advise", "state": "waiting", "updated_at": str(T0 + 20.0)},
        {"id": "d-5e6f", "action": "advise", "state": "acted", "updated_at": str(T0 + 24.0)},
    ]
    run.job = {"JobState": "COMPLETED", "Restarts": "0", "NodeList": "node[1-4]"}
    run.output = "resumed from checkpoint at step 80\n"
    summary = summarize(run)
    assert summary["recovery"] == "advice"
    assert summary["onset_to_advice_s"] == pytest.approx(9.0)
    assert summary["work_lost_steps"] == 6  # 80..85 done twice, not every step after
    healthy = summary["onset_to_healthy_s"]
    assert healthy is not None
    assert summary["action_to_healthy_s"] == pytest.approx(healthy - 9.0, abs=0.11)
    assert summary["onset_to_requeue_s"] is None
