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
