"""megatron-core's ``get_forward_backward_func``, readiness-first: change one line.

::

    # from megatron.core.pipeline_parallel import get_forward_backward_func
    from rrfp_async.megatron import get_forward_backward_func

    forward_backward_func = get_forward_backward_func()  # or (schedule_pg_collection=...)
    losses_reduced = forward_backward_func(
        forward_step_func=forward_step,
        data_iterator=data_iterator,  # a list of one per chunk with interleaving
        model=model,                  # a list of model chunks with interleaving
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )

It takes the installed megatron-core's arguments (0.16 - 0.19: the factory's ``pp_size``,
``vp_size``, ``schedule_pg_collection``; the call's keywords, ``p2p_communicator`` and
``pg_collection`` included, as Megatron-Bridge passes them), runs 1F1B or the interleaved
(virtual pipeline) schedule as megatron's factory would pick it, and refuses by name what
it does not support. rrfp_async's own keywords go to ``get_forward_backward_func(policy=...,
hint=..., memory_factor=..., step_timeout=...)``. See ``docs/compatibility.md`` for the
versions, modes and call styles, and ``rrfp_async.integrations._megatron_dropin`` for how it works.
megatron-core is an optional extra (``pip install rrfp-async[megatron]``).
"""

from .integrations import MegatronForwardBackward, get_forward_backward_func

__all__ = ["MegatronForwardBackward", "get_forward_backward_func"]
