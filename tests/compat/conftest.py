"""The compat tier: tests against the peers' current releases (compat/requirements.txt).

They run in the compat virtualenv that ``compat/env.sh`` builds (Python 3.12, torch 2.14,
megatron-core 0.19, torchtitan 0.3), through ``./dev compat``; the main suite (torch 2.13)
skips this folder. ``RRFP_COMPAT=1`` marks the compat run: without it nothing here is
collected, so a stray ``pytest tests`` in the main environment never imports the peers'
other versions.
"""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("RRFP_COMPAT") == "1" else ["test_*.py"]
