"""``python -m accelfn.cli.bench [options]``: the same as ``accelfn bench``."""

import sys

from .command import main

if __name__ == "__main__":  # not when imported (e.g. by pkgutil.walk_packages)
    sys.exit(main())
