"""The project's code, tests and documentation say what the code does, not which piece of work brought it, and live
tests probe third-party servers only through probe clients that survive a closed keep-alive connection."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Benchmark results are dated records of runs; everything else describes the code as it is.
HISTORY = ("bench/",)
#: A reference to a tracker entry or to work still to come, as text that rots: "issue #16", "(#15)",
#: "issue 14", "not implemented yet", "see the project issues".
ROT = re.compile(r"\bissues? ?#?\d+\b|\(#\d+\b|not implemented yet|see the project issues", re.IGNORECASE)


def tracked(*suffixes: str) -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / n for n in names if n.endswith(suffixes) and not n.startswith(HISTORY)]


def test_no_code_test_or_readme_names_an_issue_or_promises_later_work() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in tracked(".py", ".md", ".toml", ".txt", ".cfg", "dev", "run")
        if path != Path(__file__).resolve()  # the pattern's own examples
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if ROT.search(line)
    ]
    assert found == []


def test_the_rot_pattern_catches_what_it_is_for() -> None:
    for text in ("comes with the CLI work of issue #16", "router-front mode (issue #15)", "(#14 item 4)", "Issue 7"):
        assert ROT.search(text), text
    for text in ("an issue with the server", "the 16 tokens", "#: a comment", "color #15a"):
        assert not ROT.search(text), text


#: What opens a raw HTTP client in a live test: only the test kit's probe clients may (no keep-alive).
RAW_CLIENT = re.compile(r"\bhttpx\.(Client|AsyncClient|get|post|put|delete|request|stream)\(")


def test_live_tests_probe_real_servers_only_through_probe_clients() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in tracked(".py")
        if path.is_relative_to(ROOT / "tests" / "live")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if RAW_CLIENT.search(line)
    ]
    assert found == [], "use backends_testkit.live.probe_client / async_probe_client"
