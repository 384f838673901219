"""``python -m rrfp_async`` runs the ``rrfp-async`` command line."""

from .cli import main

main()
