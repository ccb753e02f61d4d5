"""Checks the CLI tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_plot_written_or_matplotlib_missing(
    code: int, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--plot TARGET` wrote a PNG (exit 0), or, without matplotlib, failed with exit 1,
    said how to install it and wrote nothing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert code == 1
        assert "--plot needs matplotlib" in capsys.readouterr().err
        assert not target.exists()
    else:
        assert code == 0
        assert target.read_bytes()[:8] == PNG_SIGNATURE


def usage_error_line(err: str, command: str) -> str:
    """The error line of a `hisparse COMMAND` usage error, checked to come first: the error,
    then at most one line that points at `--help` (no 10-line usage in front of it)."""
    lines = err.strip().splitlines()
    assert lines and lines[0].startswith(f"hisparse {command}: error: "), err
    assert len(lines) <= 2, err
    if len(lines) == 2:
        assert lines[1] == f"`hisparse {command} --help` lists the options", err
    return lines[0]
