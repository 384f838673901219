"""``python -m rrfp_async`` runs the ``rrfp-async`` command line."""

from ._cli import main

main()
