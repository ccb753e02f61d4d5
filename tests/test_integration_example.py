"""docs/integration.md's radix prefix cache example runs as written: three chat turns, each
admitted on the previous turn's tokens, host rows checked against the stand-in model, and
the pool whole again once the tree is evicted."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "integration.md"
MARKER = "<!-- example: radix-prefix-cache -->"


def example_source() -> str:
    text = DOC.read_text()
    after = text[text.index(MARKER) + len(MARKER):]
    match = re.match(r"\s*```python\n(.*?)\n```", after, re.S)
    assert match, f"no python block right after {MARKER} in {DOC}"
    return match.group(1)


def test_the_radix_prefix_cache_example_runs_and_shares_each_previous_turn() -> None:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(example_source(), str(DOC), "exec"), {"__name__": "example"})
    lines = printed.getvalue().splitlines()
    # Turn 0 shares nothing; turn 1 the 200 tokens of turn 0 (prompt and answer), turn 2
    # the 250 of turn 1.
    shared = [int(re.search(r"shared (\d+) of", line).group(1)) for line in lines]
    assert shared == [0, 200, 250], lines
    # Printed after the insert, before the finish: the turn's request and the tree's nodes
    # hold the same rows, more of them each turn.
    saved = [int(re.search(r"(\d+) host bytes saved", line).group(1)) for line in lines]
    assert 0 < saved[0] < saved[1] < saved[2], lines
