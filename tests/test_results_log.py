"""benchmarks/RESULTS.md's log is append-only: a recorded run is never edited or deleted, only followed by newer ones
(an older run may gain a "*Superseded: ...*" line pointing at the newer one; the newest may still grow). Checked
against the file's last two committed versions and the working tree, in git's history."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/RESULTS.md"
LOG_HEADING = "## The log (dated runs, oldest first)"
ALLOWED_INSERTION = "*Superseded"  # a pointer to a newer run (blank lines around it too)


def log_lines(text: str) -> list[str]:
    """The log part: from its heading on (the header and the current tables above it are rewritten freely)."""
    start = text.find(LOG_HEADING)
    return text[start:].splitlines() if start >= 0 else []


def append_only_problems(old: str, new: str) -> list[str]:
    """How `new`'s log is not `old`'s with runs appended: each old line must appear, in order; a line inserted before
    the old log's newest section must be a Superseded pointer or blank (that newest section, the run still being
    written up, may grow anywhere)."""
    before, after = log_lines(old), log_lines(new)
    if before and not after:
        return [f"the log's heading {LOG_HEADING!r} is gone"]
    newest = max((i for i, line in enumerate(before) if line.startswith("## ")), default=0)
    problems, at = [], 0
    for index, line in enumerate(before):
        while at < len(after) and after[at] != line:
            inserted = after[at]
            if index <= newest and inserted.strip() and not inserted.startswith(ALLOWED_INSERTION):
                problems.append(f"inserted inside an older run: {inserted!r}")
            at += 1
        if at == len(after):
            return [*problems, f"edited or deleted from the log: {line!r}"][:5]
        at += 1
    return problems[:5]


def committed_versions() -> list[str]:
    """The file's text at its last two commits (newest first); empty without git or history."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return []
    run = lambda *args: subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)  # noqa: E731
    commits = run("log", "-2", "--format=%H", "--", RESULTS).stdout.split()
    return [run("show", f"{commit}:{RESULTS}").stdout for commit in commits]


def test_the_results_log_is_append_only():
    versions = committed_versions()
    if not versions:
        pytest.skip("needs the repository's git history (a clone, not an unpacked archive)")
    current = (ROOT / RESULTS).read_text()
    pairs = [(versions[0], current)] + ([(versions[1], versions[0])] if len(versions) > 1 else [])
    for old, new in pairs:
        problems = append_only_problems(old, new)
        assert not problems, "benchmarks/RESULTS.md's log changed, not appended to:\n" + "\n".join(problems)


def test_an_edited_or_deleted_log_line_is_caught():
    current = (ROOT / RESULTS).read_text()
    assert append_only_problems(current, current + "\n## a newer run\n| a | b |\n") == []
    first_run = next(line for line in log_lines(current) if line.startswith("| ") and "|" in line[2:])
    assert append_only_problems(current, current.replace(first_run, first_run + " edited", 1))
    assert append_only_problems(current, current.replace(first_run + "\n", "", 1))
    heading = next(line for line in log_lines(current) if line.startswith("### "))
    pointer = heading + "\n*Superseded: a newer run, [there](#there).*"
    assert append_only_problems(current, current.replace(heading, pointer, 1)) == []
    assert append_only_problems(current, current.replace(heading, heading + "\nan edit in the middle", 1))
