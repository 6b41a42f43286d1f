"""The README's two one-line commands are the ones users and CI run; keep them honest."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README must open with a bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_exactly_two_commands():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert "examples/quickstart.py" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_commands()[1] in ci


def test_readme_links_exist():
    text = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\(((?:docs|examples)/[^)#]+)\)", text):
        assert (ROOT / link).exists(), link
    for path in re.findall(r"`((?:examples|docs)/[\w./-]+\.(?:py|md|yaml))`", text):
        assert (ROOT / path).exists() or "*" in path, path
