"""The examples run (small sizes)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    ("name", "argv"),
    [
        ("custom_policy.py", []),
        ("embed_in_asyncio.py", []),
        ("what_if_128_gpus.py", ["--stages", "4", "--replicas", "2", "--microbatches", "8"]),
    ],
)
def test_example_runs(
    name: str, argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", [name, *argv])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    out = capsys.readouterr().out
    assert "speedup" in out or "heartbeat" in out
