"""The compat environment is the one the compat tier claims to test against."""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path

import pytest

REQUIREMENTS = Path(__file__).resolve().parents[2] / "compat" / "requirements.txt"


def _pins() -> dict[str, str]:
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    return pins


@pytest.mark.parametrize("name", sorted(_pins()))
def test_the_pinned_releases_are_installed(name: str) -> None:
    got = md.version(name)
    assert got.split("+")[0] == _pins()[name], f"{name} {got} (want {_pins()[name]})"


def test_python_312_and_the_checkouts_code() -> None:
    import rrfp_async

    assert sys.version_info[:2] == (3, 12)
    # The tier tests this checkout (PYTHONPATH), not an installed copy.
    assert Path(rrfp_async.__file__).resolve().parents[1] == REQUIREMENTS.parents[1]
