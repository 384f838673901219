"""Benchmark bodies: what ``rrfp-async bench ...`` and ``demo`` measure.

A layer of its own above ``integrations`` and below ``cli`` (the thin command layer, which
imports these modules inside its commands so that ``--help`` stays fast). Every benchmark
prints ratios measured side by side in one run; on a CPU, GPU time is emulated (real torch
compute plus a sleep from a declared cost model on a compute thread). The modules are
private; the commands and ``BENCHMARKS.md`` are the interface.
"""
