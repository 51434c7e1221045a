"""``python -m accelfn`` runs the ``accelfn`` command line."""

from .cli import main

raise SystemExit(main())
