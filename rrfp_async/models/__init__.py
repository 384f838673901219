"""Moved: the example model is the lab's, ``rrfp_lab.models`` (the runtime ships no model).

Until 0.2 ``rrfp_async.models`` and its modules (``rrfp_async.models.image_text``) still
resolve, to the lab's modules themselves, with a ``DeprecationWarning``. The lab is looked up
by name here, never imported by the runtime's layers (tests/test_layers.py).
"""

import importlib
import sys
import warnings

warnings.warn(
    "rrfp_async.models moved to rrfp_lab.models (the example model is lab, not runtime):"
    " `from rrfp_lab.models import ...`; the old path goes in 0.2",
    DeprecationWarning,
    stacklevel=2,
)

_lab = importlib.import_module("rrfp_lab.models")
for _name in ("image_text", "_tp"):
    # ``import rrfp_async.models.image_text`` finds the lab's module (the same object).
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"rrfp_lab.models.{_name}")
__all__ = list(_lab.__all__)
globals().update({n: getattr(_lab, n) for n in __all__})
