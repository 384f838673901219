"""The ``rrfp-async`` command line (tools, not library API): ``main``, the group.

Its own commands are the runtime's (``simulate``, ``trace``); the benchmarks and the demo
are the lab's (``rrfp_lab``), which registers them as command plug-ins (see ``_main``).

Internal to the package family: imported here for the lab's commands (``rrfp_lab.cli``),
which share the runtime's options and output, not in ``__all__``: the options
``hint_option``, ``jitter_option``, ``json_option``, ``latency_option``, ``log_choice``,
``log_options``, ``memory_budget_option``, ``memory_factor_option``,
``microbatches_option``, ``policy_names``,
``policy_option``, ``repeats_option``, ``seed_option``, ``stages_option``, ``steps_option``,
``tp_option``; the output ``CleanErrorsGroup``, ``console``, ``optional_png``,
``progress``, ``speedup_table``, ``table``.
"""

from ._main import COMMANDS_GROUP as COMMANDS_GROUP
from ._main import main
from ._options import hint_option as hint_option
from ._options import jitter_option as jitter_option
from ._options import json_option as json_option
from ._options import latency_option as latency_option
from ._options import log_choice as log_choice
from ._options import log_options as log_options
from ._options import memory_budget_option as memory_budget_option
from ._options import memory_factor_option as memory_factor_option
from ._options import microbatches_option as microbatches_option
from ._options import policy_names as policy_names
from ._options import policy_option as policy_option
from ._options import repeats_option as repeats_option
from ._options import seed_option as seed_option
from ._options import stages_option as stages_option
from ._options import steps_option as steps_option
from ._options import tp_option as tp_option
from ._output import CleanErrorsGroup as CleanErrorsGroup
from ._output import console as console
from ._output import optional_png as optional_png
from ._output import progress as progress
from ._output import speedup_table as speedup_table
from ._output import table as table

__all__ = ["COMMANDS_GROUP", "main"]
