"""Every bundled example file runs the way README.md shows it: a file run by a
`spec-run` command passes spec-run's validation on the demo pair, and the file of the
Batch API snippet has every line on the snippet's endpoint (spec-serve fails a batch
with one line on another)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import engine
from jobstore import config
from jobstore.jobfile import CHAT_URL, COMPLETION_URL, validate_lines
from worker.local import context_check

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
#: The README's `spec-run FILE` commands, and its Batch API snippet's file and endpoint.
SPEC_RUN = set(re.findall(r"spec-run (examples/\S+\.jsonl)", README))
SNIPPET = re.search(r'open\("(examples/[^"]+\.jsonl)".*?endpoint="([^"]+)"', README, re.S)
ENDPOINTS = {CHAT_URL: "chat", COMPLETION_URL: "completion"}


@pytest.fixture(scope="module")
def demo():
    return engine.load_pair()


def test_the_readme_shows_how_to_run_every_example_file():
    assert SNIPPET is not None, "README.md: no Batch API snippet opening an example file"
    shown = SPEC_RUN | {SNIPPET.group(1)}
    bundled = {p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").glob("*.jsonl")}
    assert bundled and bundled == shown


@pytest.mark.parametrize("name", sorted(SPEC_RUN | {SNIPPET.group(1)} if SNIPPET else SPEC_RUN))
def test_every_example_line_passes_spec_runs_validation_on_the_demo_pair(demo, name):
    check = context_check(demo, config.DEFAULT_MODEL)
    verdicts = list(validate_lines(str(ROOT / name), None, check))
    assert verdicts
    assert [(v.line, v.message()) for v in verdicts if v.job is None] == []
    assert {v.job.model for v in verdicts} <= {None, config.DEFAULT_MODEL}  # served by spec-run


def test_the_batch_api_example_uses_the_snippets_endpoint_on_every_line():
    name, endpoint = SNIPPET.groups()
    assert endpoint in ENDPOINTS, f"README.md's snippet: endpoint {endpoint!r}"
    jobs = [v.job for v in validate_lines(str(ROOT / name), None)]
    wrong = [(j.line, j.endpoint) for j in jobs if j.endpoint != ENDPOINTS[endpoint]]
    assert wrong == [], f"{name}: lines not on {endpoint}"


def test_both_temperature_defaults_are_stated_where_a_user_looks():
    """A job-file line samples (1.0, OpenAI's default), spec-generate is greedy (0.0):
    `spec-generate --help` and the README say which applies where, from
    contract.defaults."""
    from click.testing import CliRunner

    from contract.defaults import ENGINE, JOB_FILE
    from engine.cli import main

    shown = " ".join(CliRunner().invoke(main, ["--help"]).output.split())
    assert (ENGINE.temperature, JOB_FILE.temperature) == (0.0, 1.0)
    assert f"this command's default; a job-file line's default is {JOB_FILE.temperature}" in shown
    assert f"[default: {ENGINE.temperature}; x>=0]" in shown
    readme = " ".join(README.split())
    assert (
        "a job-file line (`spec-run`, `spec-submit`, `spec-serve`) samples at 1.0, as in the "
        "OpenAI API; `spec-generate` and `engine.GenerationRequest` are greedy (0.0)"
    ) in readme
