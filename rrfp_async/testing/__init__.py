"""Test doubles and helpers: what the suite (and a user's own tests) runs the runtime with.

* ``nccl_rules``: NCCL's rules checked on a CPU, a test double over gloo that presents
  itself as NCCL (``CheckedGroup``, ``install``...): never a transport. ``RRFP_NCCL_RULES``
  makes ``build_groups`` use it for the payload communicators; its design note says what it
  models (ARCHITECTURE.md, invariant 11);
* ``nccl_logs``: its other half, the observed gloo control group (``ObservedGroup``) and the
  logs' check (``check_logs``);
* ``free_port``: a free TCP port on 127.0.0.1 for a rendezvous.

This layer sits above ``channels/`` (the checker reads the wire format's message kinds) and
below ``distributed/`` (whose group wiring swaps the checker in).
"""

from . import _nccl_logs, _nccl_rules
from ._ports import free_port

#: The checker's two modules, under their public names.
nccl_rules = _nccl_rules
nccl_logs = _nccl_logs

__all__ = ["free_port", "nccl_logs", "nccl_rules"]
