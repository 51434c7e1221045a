"""The ``accelfn`` command: ``doctor`` and ``bench``."""
