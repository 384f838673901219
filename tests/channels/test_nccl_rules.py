"""The NCCL-rules checker (``rrfp_async.testing.nccl_rules``): each rule it models fails
when broken (in one process, over a loopback stand-in for gloo), the logs' order check names the
deadlock, and a real 2-rank pipeline step runs under it with no violation."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn

import rrfp_async as rr
from rrfp_async._streams import HostEvent, HostStream, use_host_stream
from rrfp_async.channels import _wire
from rrfp_async.testing import nccl_logs as logs
from rrfp_async.testing import nccl_rules as rules
from tests._pool import pooled_spawn

pytestmark = pytest.mark.timeout(120)


class _Done:
    def wait(self, *_: Any) -> bool:
        return True


class _Recv:
    def __init__(self, q: queue.Queue[torch.Tensor], buf: torch.Tensor) -> None:
        self._q, self._buf = q, buf

    def wait(self, *_: Any) -> bool:
        self._buf.copy_(self._q.get(timeout=30))
        return True


class _Loopback:
    """One end of a 2-rank stand-in for a gloo group, in one process."""

    def __init__(self, me: int, wires: dict[tuple[int, int], queue.Queue[torch.Tensor]]):
        self.me, self.wires = me, wires

    def rank(self) -> int:
        return self.me

    def size(self) -> int:
        return 2

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _Done:
        self.wires[(self.me, dst)].put(tensors[0].clone())
        return _Done()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _Recv:
        return _Recv(self.wires[(src, self.me)], tensors[0])


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh registry logging under ``tmp_path``."""
    monkeypatch.setenv(rules.RULES_ENV, str(tmp_path))
    monkeypatch.setattr(rules, "_registry", None)
    yield tmp_path
    if rules._registry is not None:
        rules._registry.close()


def _pair(ranks: tuple[int, int] = (0, 1)) -> tuple[rules.CheckedGroup, rules.CheckedGroup]:
    wires: dict[tuple[int, int], queue.Queue[torch.Tensor]] = {
        (0, 1): queue.Queue(),
        (1, 0): queue.Queue(),
    }
    m = {0: ranks[0], 1: ranks[1]}
    a = rules.CheckedGroup(_Loopback(0, wires), register=False, ranks=m, model_init=False)
    b = rules.CheckedGroup(_Loopback(1, wires), register=False, ranks=m, model_init=False)
    return a, b


def _announce(src: int, dst: int) -> None:
    """What the observed control group does when a DATA_DEVICE header arrives."""
    reg = rules._reg()
    reg.announced[(src, dst)] = reg.announced.get((src, dst), 0) + 1
    reg.issued[(src, dst)] = reg.issued.get((src, dst), 0)


def test_a_receive_completes_on_its_stream_and_reads_poison_before_the_event(fresh: Path) -> None:
    a, b = _pair()
    b.lag = 2.0  # the model device runs the receive late: the read below comes before it
    x = torch.arange(6, dtype=torch.float32)
    out = torch.zeros(6)
    sa, sb = HostStream("a"), HostStream("b")
    with use_host_stream(sa):
        a.send([x], 1).wait()
    _announce(0, 1)
    with use_host_stream(sb):
        b.recv([out], 0).wait()
        ev = HostEvent()
        ev.record()
    # Before the event: the buffer holds the checker's poison (NaN), not zeros, not data.
    assert torch.isnan(out).all()
    ev.synchronize(timeout=30)
    assert torch.equal(out, x)
    assert logs.check_logs(fresh) == []


def test_wait_with_the_default_stream_current_is_refused(fresh: Path) -> None:
    a, _ = _pair()
    w = a.send([torch.ones(2)], 1)
    with pytest.raises(rules.NCCLRuleError, match="no comm stream current"):
        w.wait()


def test_two_issuing_threads_on_one_communicator_are_refused(fresh: Path) -> None:
    a, _ = _pair()
    s = HostStream()
    with use_host_stream(s):
        a.send([torch.ones(2)], 1).wait()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            a.send([torch.ones(2)], 1)
        except rules.NCCLRuleError as e:
            errors.append(e)

    t = threading.Thread(target=other, name="second-sender")
    t.start()
    t.join()
    assert len(errors) == 1 and "one issuing thread per communicator" in str(errors[0])
    assert "second-sender" in str(errors[0])


def test_two_threads_issuing_at_once_on_two_communicators_are_refused(fresh: Path) -> None:
    a, _ = _pair()
    c, _ = _pair((0, 2))
    a.lag = 0.8  # a wide issue window on the first communicator
    errors: list[BaseException] = []

    def first() -> None:
        a.send([torch.ones(2)], 1)

    t = threading.Thread(target=first, name="first")
    t.start()
    time.sleep(0.05)
    try:
        c.send([torch.ones(2)], 1)
    except rules.NCCLRuleError as e:
        errors.append(e)
    t.join()
    assert len(errors) == 1 and "no two threads issue at once" in str(errors[0])


def test_a_receive_posted_before_its_header_is_refused(fresh: Path) -> None:
    _, b = _pair()
    with pytest.raises(rules.NCCLRuleError, match="posted before a header announced"):
        b.recv([torch.empty(2)], 0)


def test_the_observed_control_group_counts_announcements_and_orders_them(fresh: Path) -> None:
    wires: dict[tuple[int, int], queue.Queue[torch.Tensor]] = {
        (0, 1): queue.Queue(),
        (1, 0): queue.Queue(),
    }
    m = {0: 0, 1: 1}
    ctl0 = logs.ObservedGroup(_Loopback(0, wires), register=False, ranks=m)
    ctl1 = logs.ObservedGroup(_Loopback(1, wires), register=False, ranks=m)
    header = [_wire.MAGIC, _wire.DATA_DEVICE] + [0] * (_wire.HEADER_LEN - 2)
    msg = torch.tensor(header, dtype=torch.int64)
    # The header before its payload's send: refused.
    with pytest.raises(rules.NCCLRuleError, match="posted before its payload's send"):
        ctl0.send([msg], 1)
    rules._reg().issued[(0, 1)] = 1
    ctl0.send([msg], 1)
    buf = torch.empty(_wire.HEADER_LEN, dtype=torch.int64)
    ctl1.recv([buf], 0).wait()
    assert rules._reg().announced[(0, 1)] == 1


def test_a_tensor_freed_before_its_send_ran_is_caught(fresh: Path) -> None:
    a, _ = _pair()
    a.lag = 0.05
    s = HostStream()
    with use_host_stream(s):
        a.send([torch.ones(1000)], 1).wait()  # nobody keeps the tensor
        ev = HostEvent()
        ev.record()
    with pytest.raises(rules.NCCLRuleError, match="freed before the operation ran"):
        ev.synchronize(timeout=30)


def test_a_reused_send_buffer_sends_what_it_holds_when_the_send_runs(fresh: Path) -> None:
    a, b = _pair()
    a.lag = 0.05
    buf = torch.zeros(4)
    with use_host_stream(HostStream()):
        a.send([buf], 1).wait()
    buf.fill_(7.0)  # overwritten right after the send was issued, before it ran
    _announce(0, 1)
    out = torch.empty(4)
    with use_host_stream(HostStream()):
        b.recv([out], 0).wait()
        ev = HostEvent()
        ev.record()
    ev.synchronize(timeout=30)
    assert out.tolist() == [7.0] * 4  # the model reads late, as a device stream may


def test_host_packed_buffers_and_host_reads_of_payloads_are_refused(fresh: Path) -> None:
    a, _ = _pair()
    header = _wire.encode_header(0, 0, rr.Task(1, "F", 0), torch.zeros(2), inline=True)
    with (
        use_host_stream(HostStream()),
        pytest.raises(rules.NCCLRuleError, match="packed on the host by pack_inline"),
    ):
        a.send([_wire.pack_inline(header, torch.zeros(2))], 1)
    a2, b2 = _pair()
    x = torch.zeros(_wire.HEADER_BYTES, dtype=torch.uint8)
    with use_host_stream(HostStream()):
        a2.send([x], 1).wait()
    _announce(0, 1)
    raw = torch.empty(_wire.HEADER_BYTES, dtype=torch.uint8)
    with use_host_stream(HostStream()):
        b2.recv([raw], 0).wait()
    with pytest.raises(rules.NCCLRuleError, match=r"ctypes\.string_at"):
        _wire.read_header(raw)  # the host reading a device payload (ctypes)
    with pytest.raises(rules.NCCLRuleError, match=r"Tensor\.tolist"):
        _wire.read_header(raw.view(torch.int64))


def _op(job: str, comm: str, rank: int, peer: int, op: str, n: int, nbytes: int) -> str:
    import json

    return json.dumps(
        {
            "job": job,
            "pid": rank,
            "kind": "op",
            "comm": comm,
            "rank": rank,
            "peer": peer,
            "op": op,
            "n": n,
            "nbytes": nbytes,
            "thread": f"t{rank}",
        }
    )


def test_the_logs_name_both_ends_receiving_first_as_a_deadlock(tmp_path: Path) -> None:
    # Two ranks that each keep a header receive posted on one communicator, then send.
    (tmp_path / "ops-0.jsonl").write_text(
        "\n".join(
            [_op("j", "0-1#0", 0, 1, "recv", 0, 128), _op("j", "0-1#0", 0, 1, "send", 1, 128)]
        )
    )
    (tmp_path / "ops-1.jsonl").write_text(
        "\n".join(
            [_op("j", "0-1#0", 1, 0, "recv", 0, 128), _op("j", "0-1#0", 1, 0, "send", 1, 128)]
        )
    )
    (problem,) = logs.check_logs(tmp_path)
    assert "operation 0 of global ranks 0 and 1: both receive" in problem
    assert "a deadlock" in problem
    # Matched ends, then a count that differs.
    (tmp_path / "ops-0.jsonl").write_text(
        "\n".join([_op("k", "0-1#0", 0, 1, "send", 0, 64), _op("k", "0-1#0", 0, 1, "send", 1, 8)])
    )
    (tmp_path / "ops-1.jsonl").write_text(
        "\n".join([_op("k", "0-1#0", 1, 0, "recv", 0, 64), _op("k", "0-1#0", 1, 0, "recv", 1, 16)])
    )
    (problem,) = logs.check_logs(tmp_path)
    assert "operation 1" in problem and "matches the count exactly" in problem


# ----------------------------------------------------------------- a real pipeline step


class _Stage(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.tanh(self.lin(x))
        return (h, {"skip": h * 0.5}) if isinstance(x, torch.Tensor) else h


class _Second(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.lin(h) + extra["skip"]


def _loss(out: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _mbs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(2 + i, 8, generator=g) for i in range(4)]


def _rules_rank(rank: int, world: int) -> dict[str, Any]:
    from rrfp_async import _streams

    bound: set[str] = set()
    bind = _streams.Device.bind_thread

    def spy(self: _streams.Device) -> None:  # which threads bind the stage's device
        bound.add(threading.current_thread().name.rsplit("-", 1)[0])
        bind(self)

    _streams.Device.bind_thread = spy  # type: ignore[method-assign]
    layout = rr.ProcessLayout.from_world(pp=2)
    groups = rr.build_groups(layout)
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=4)
    sched = rr.StepSchedule.build(plan, "1f1b")
    mod = _Stage(0) if rank == 0 else _Second(1)
    ex = rr.TorchStageExecutor({rank: mod}, _loss if rank == 1 else None, rank=rank)

    stage_on_device = [False]

    async def run() -> None:
        async with rr.DistributedStage(layout, sched, ex, groups=groups) as stage:
            stage_on_device[0] = stage.channel.on_device
            for s in range(2):
                await stage.run_step(_mbs(), step=s)

    try:
        rr.run(run())
    finally:
        ex.close()
    return {
        "grads": {k: p.grad.clone() for k, p in mod.named_parameters() if p.grad is not None},
        "losses": dict(ex.losses),
        "bound": sorted(bound),
        "on_device": stage_on_device[0],
    }


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_pipeline_step_keeps_nccls_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rules.RULES_ENV, str(tmp_path))
    res = pooled_spawn(_rules_rank, 2, timeout=220)
    assert logs.check_logs(tmp_path) == []
    # Not vacuous: payloads went over the checked communicators, both ways.
    ops = [ln for f in tmp_path.glob("ops-*.jsonl") for ln in f.read_text().splitlines()]
    assert sum('"op": "send"' in ln for ln in ops) >= 2 * 2 * 4
    # The device path ran, and every thread of the transport bound the stage's device.
    for r in res:
        assert r["on_device"]
        assert {"rrfp-recv-0", "rrfp-recv-1", "rrfp-send-0", "rrfp-send-1"} & set(r["bound"])
        assert "rrfp-issue" in r["bound"], r["bound"]
    # And the step computed what one process computes.
    a, b = _Stage(0), _Second(1)
    for mb in _mbs():
        h, extra = a(mb)
        (_loss(b(h, extra), mb) / 4).backward()
    want = [dict(a.named_parameters()), dict(b.named_parameters())]
    for rank in (0, 1):
        for k, g in res[rank]["grads"].items():
            torch.testing.assert_close(
                g, 2 * cast(torch.Tensor, want[rank][k].grad), rtol=1e-6, atol=1e-6
            )


_STALL_CHILD = """
import sys, time
from rrfp_async.testing import _nccl_rules as core
reg = core._reg()
reg.running[1] = (time.monotonic(), "send #0 on communicator x (a test's)")
reg.start_watchdog()
print("ready", flush=True)
sys.stdin.readline()  # the operation runs until the test says
with reg.lock:
    reg.running.pop(1)
reg.close()
"""


def _stall_child(tmp_path: Path, *, stop_for: float, then: float) -> list[str]:
    """A process with one operation running (a 2 s stall limit), SIGSTOPped ``stop_for`` s
    at its start, that ends ``then`` s later; what its logs show."""
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, rules.RULES_ENV: str(tmp_path), rules.STALL_ENV: "2"}
    with subprocess.Popen(
        [sys.executable, "-c", _STALL_CHILD],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            assert proc.stdout.readline().strip() == "ready"
            if stop_for:
                os.kill(proc.pid, signal.SIGSTOP)
                time.sleep(stop_for)
                os.kill(proc.pid, signal.SIGCONT)
            time.sleep(then)
            proc.stdin.write("done\n")
            proc.stdin.flush()
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()
    return logs.check_logs(tmp_path)


def test_an_operation_running_past_the_limit_is_a_stall(tmp_path: Path) -> None:
    problems = _stall_child(tmp_path, stop_for=0, then=3.5)
    assert len(problems) == 1 and "stalled for 2 s: send #0 on communicator x" in problems[0]


def test_time_the_process_was_stopped_is_no_stall(tmp_path: Path) -> None:
    """SIGSTOPped 4 s while its operation runs, which then ends 1 s later: no stall (no peer
    kept it waiting: the process did not run). Red when the watchdog counts the stop."""
    assert _stall_child(tmp_path, stop_for=4.0, then=1.0) == []
