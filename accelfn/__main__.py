"""``python -m accelfn`` runs the ``accelfn`` command line."""

from .cli.main import main

raise SystemExit(main())
