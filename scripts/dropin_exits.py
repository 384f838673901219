"""Do programs that use the drop-ins without ``close()`` exit cleanly under torchrun?

    python scripts/dropin_exits.py --runs 20                 # every mode, 20 runs each
    python scripts/dropin_exits.py --runs 20 --mode tutorial --nproc 4

Each run is ``torchrun --standalone`` of ``tests/integrations/exit_jobs/torch_job.py MODE``
(torch pipelining programs as users write them, the schedule class swapped, no ``close()``;
its docstring lists the modes), and of ``examples/megatron_dropin.py`` (modes ``megatron``,
``megatron_vp``: Megatron-LM's call, no ``close()``; needs megatron-core). A run is good
when torchrun exits 0, every rank printed its ``done`` line (the last rank its 3 losses, for
Megatron) and no rank aborted ("terminate called", SIGABRT). Prints one line per mode
(good / runs) and the log of the first bad run; exits 1 if any run was bad.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "integrations" / "exit_jobs" / "torch_job.py"
MODES = ("tutorial", "loop", "no_destroy", "by_name", "collected", "async", "interleaved", "vshape")
# Megatron's drop-in: examples/megatron_dropin.py (written as Megatron-LM's training.py calls
# the schedule; no close()) under torchrun, 1F1B and interleaved. Needs megatron-core.
MEGATRON = {"megatron": [], "megatron_vp": ["--vp", "2"]}


def run_job(mode: str, nproc: int = 2, timeout: float = 180.0) -> tuple[bool, str]:
    """One torchrun of the job in ``mode``: (good, its log)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(nproc), "--max-restarts", "0"]
    if mode in MEGATRON:
        cmd += [str(ROOT / "examples" / "megatron_dropin.py"), *MEGATRON[mode]]
        done_line, want = "mean lm loss", 3  # the last rank prints its 3 steps
    else:
        cmd += [str(JOB), mode]
        done_line, want = f"done {mode}", nproc
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return False, f"timed out after {timeout} s\n{out}"
    log = p.stdout + p.stderr
    # Counted in the whole log: two ranks' lines may interleave (unbuffered output).
    done = log.count(done_line)
    good = p.returncode == 0 and done == want and "terminate called" not in log
    return good, f"exit {p.returncode}, {done} of {want} '{done_line}' lines\n{log}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument(
        "--mode", action="append", choices=MODES + tuple(MEGATRON), help="default: every mode"
    )
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    bad_log = None
    for mode in args.mode or MODES + tuple(MEGATRON):
        good = 0
        for _ in range(args.runs):
            ok, log = run_job(mode, args.nproc)
            good += ok
            if not ok and bad_log is None:
                bad_log = f"--- first bad run ({mode}) ---\n{log}"
        print(f"{mode:12} {good}/{args.runs} runs exited 0 on every rank", flush=True)
    if bad_log is not None:
        print(bad_log[-6000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
