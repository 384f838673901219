"""``DistributedStage``'s flat TP keywords, resolved into one ``TPOptions``.

``TPOptions`` itself lives in the loop layer (``rrfp_async.loop``), shared by the three
entry points (``StageLoop``, ``LocalPipeline`` with ``simulate``, ``DistributedStage``).
"""

from __future__ import annotations

from ..loop import UNSET, TPOptions, resolve_tp_options

__all__ = ["KEYWORD_FIELDS", "UNSET", "TPOptions", "tp_options"]

KEYWORD_FIELDS = {
    "coordinate_tp": "coordinate",
    "verify_tp": "verify",
    "fold_tp_check": "fold_check",
    "deduce_tp": "deduce",
}
"""``DistributedStage``'s flat TP keyword -> the ``TPOptions`` field it sets."""


def tp_options(tp: TPOptions | None, who: str, **keywords: object) -> TPOptions:
    """The stage's ``TPOptions``: ``tp``, or one made of the flat keywords that were given
    (``KEYWORD_FIELDS``; a keyword left out is ``UNSET``).

    Raises:
        PlanError: ``tp`` is no ``TPOptions``, both ``tp`` and a flat keyword are given
            (the message names them), or a flat keyword is not a bool.
    """
    return resolve_tp_options(tp, who, KEYWORD_FIELDS, keywords)
