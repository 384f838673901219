"""The library's logs follow the standard library's conventions until the application (or
the CLI, through ``configure_logging``) configures structlog; ``configure_logging`` writes
each record whole, in one write."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import structlog

import rrfp_async as rr
from rrfp_async.observability import _events as ev
from rrfp_async.observability._logging import LogObserver, configure_logging

ROOT = Path(__file__).resolve().parents[1]


def _ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "rrfp_async"]


def test_unconfigured_the_applications_level_applies_and_nothing_goes_to_stdout(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: structlog's default printed every debug event to stdout, whatever level the
    application had set."""
    caplog.set_level(logging.WARNING, logger="rrfp_async")
    obs = LogObserver()
    rr.simulate(stages=2, microbatches=2, observer=obs)
    assert obs.active is False  # INFO is filtered out: the observer costs one check a step
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    assert _ours(caplog) == []


def test_unconfigured_events_reach_the_applications_handlers_with_their_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="rrfp_async")
    rr.simulate(stages=2, microbatches=1, observer=LogObserver())
    records = _ours(caplog)
    events = [r.msg["event"] for r in records]  # type: ignore[index]
    assert events.count(ev.TASK_START) == 4 and events.count(ev.STEP_START) == 2
    for r in records:
        fields: Any = r.msg
        assert {"rank", "stage", "step", "clock", "event"} <= set(fields), fields
        # Any formatter shows "event key=value ...".
        assert r.getMessage().startswith(f"{fields['event']} rank={fields['rank']!r} ")
        want = logging.INFO if fields["event"] in (ev.STEP_START, ev.STEP_END) else logging.DEBUG
        assert r.levelno == want, (r.levelname, fields["event"])
    start = next(r for r in records if r.msg["event"] == ev.TASK_START)  # type: ignore[index]
    assert "task='0F0'" in start.getMessage()


def test_a_processor_formatter_renders_the_same_fields_as_json() -> None:
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.JSONRenderer(),
            ]
        )
    )
    log = logging.getLogger("rrfp_async")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        rr.simulate(stages=2, microbatches=1, observer=LogObserver())
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert {x["event"] for x in lines} >= {ev.STEP_START, ev.TASK_START, ev.DECISION}
    for x in lines:
        assert {"rank", "stage", "step", "clock"} <= set(x), x


_NO_CONFIG = textwrap.dedent(
    """
    import rrfp_async as rr

    async def explode(view):
        if view.rank == 1:
            raise RuntimeError("policy bug on purpose")
        return view.ready[0]

    try:
        rr.simulate(stages=2, microbatches=2, policy=explode, observer=rr.LogObserver())
    except rr.errors.PolicyError:
        pass
    """
)


@pytest.mark.timeout(120)
def test_with_no_logging_configured_only_the_failure_reaches_stderr() -> None:
    """No handler anywhere: Python's last-resort handler prints warnings and above (here
    the failed step's ``stage_dump``) to stderr; no debug or info event is printed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", _NO_CONFIG],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    err = proc.stderr.splitlines()
    assert len(err) == 1 and err[0].startswith(f"{ev.STAGE_DUMP} rank=1 stage=1 step=0"), err
    assert "policy bug on purpose" in err[0]


def test_configure_logging_writes_each_record_whole_in_one_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r, w = os.pipe()
    stream = os.fdopen(w, "w")  # block-buffered: what it holds must go out first
    writes: list[bytes] = []
    real_write = os.write

    def spy(fd: int, data: Any) -> int:
        if fd == w:
            writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", spy)
    try:
        stream.write("printed before\n")
        configure_logging(format="json", level="debug", stream=stream)
        rr.simulate(stages=2, microbatches=1, observer=LogObserver())
        stream.flush()
    finally:
        stream.close()
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    records = [x for x in writes if x != b"printed before\n"]
    assert len(records) > 20
    for x in records:  # one write, one record, one line
        assert x.endswith(b"\n") and x.count(b"\n") == 1, x
        assert {"rank", "stage", "step", "clock", "event"} <= set(json.loads(x)), x
    assert out.splitlines()[0] == "printed before"
    assert out == "printed before\n" + b"".join(records).decode()


class _Recording(io.StringIO):
    """A stream without a file descriptor that records its write calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_configure_logging_on_a_stream_without_a_descriptor_writes_whole_lines() -> None:
    for fmt in ("json", "console"):
        stream = _Recording()
        configure_logging(format=fmt, level="debug", stream=stream)  # type: ignore[arg-type]
        rr.simulate(stages=2, microbatches=1, observer=LogObserver())
        assert len(stream.calls) > 20
        assert all(c.endswith("\n") and c.count("\n") == 1 for c in stream.calls), fmt
