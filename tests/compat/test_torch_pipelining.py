"""The torch pipelining drop-in's tests again, on the compat environment's torch (2.14).

The same test bodies as the main suite's (imported, so both tiers hold the drop-in to one
standard); there, torch 2.14's own pre-split ``step(arg_mbs=, ...)`` is the reference too.
"""

from __future__ import annotations

from tests.integrations.test_dropin_bytes import (  # noqa: F401
    test_a_byte_budget_holds_and_training_is_unchanged,
    test_sizes_learn_the_bytes_and_then_a_step_holds_its_measured_budget,
)
from tests.integrations.test_torch_call_styles import (  # noqa: F401
    test_inputs_torch_refuses_are_refused_alike,
    test_the_classes_are_torchs_kinds,
    test_torchs_zbv_order_as_the_hint_on_three_ranks_gives_torchs_result,
    test_torchtitan_call_style_gives_torchs_result,
    torch_has_presplit_step,
)
from tests.integrations.test_torch_pipelining import (  # noqa: F401
    test_keyword_inputs_reach_every_stage_as_in_torch,
    test_same_script_one_changed_line_same_parameters_as_torch,
    test_step_async_trains_like_torch,
    test_unsupported_features_are_named,
    test_variable_length_microbatches_torch_cannot_take,
)


def test_this_torch_has_the_presplit_call() -> None:
    """The compat torch is the one whose pre-split call the tests compare against."""
    assert torch_has_presplit_step()
