"""The README's glossary names every measure the service records and the CLI shows: a new
column or decision field without its line there fails here."""

from __future__ import annotations

import re
from pathlib import Path

from slurm_plugin.store import decision

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
GLOSSARY = README[README.index("## Glossary") : README.index("## Status")]

#: The measures a person reads in `straggler nodes`, `job show`, decisions and backtests.
MEASURES = (
    "step_s",
    "compute_s",
    "comm_s",
    "data_s",
    "slowdown_pct",
    "job_loss_pct",
    "cusum_ratio",
    "since_ts",
    "decayed_incidents",
    "lasting_p",
    "saved_s",
    "cost_s",
    "deployment_id",
)


def test_every_measure_is_in_the_glossary() -> None:
    assert [m for m in MEASURES if f"`{m}`" not in GLOSSARY] == []


def test_score_is_no_longer_a_word_of_ours() -> None:
    """`score` meant a CUSUM ratio in one place and a decayed count in another."""
    assert not re.search(r"`score`", README)


def test_the_glossary_words_are_the_records_words() -> None:
    """The measures a decision records are spelled as the glossary spells them."""
    for name in ("slowdown_pct", "cusum_ratio", "since_ts", "lasting_p", "saved_s", "cost_s"):
        assert name in decision.FIELDS, name
