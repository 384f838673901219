"""megatron-core's ``get_forward_backward_func``, readiness-first: change one line.

::

    # from megatron.core.pipeline_parallel import get_forward_backward_func
    from rrfp_async.megatron import get_forward_backward_func

    forward_backward_func = get_forward_backward_func()
    losses_reduced = forward_backward_func(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )

rrfp_async's own keywords go to ``get_forward_backward_func(policy=..., hint=...,
memory_factor=..., step_timeout=...)``. See ``rrfp_async.integrations._megatron`` for what
is supported. megatron-core is an optional extra (``pip install rrfp-async[megatron]``).
"""

from .integrations import MegatronForwardBackward, get_forward_backward_func

__all__ = ["MegatronForwardBackward", "get_forward_backward_func"]
