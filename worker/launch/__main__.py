"""``bitps-launch`` and ``python -m bitps.worker.launch``: the entry point of the local cluster
launcher, whose code is the library module :mod:`bitps.worker.launch.launcher`."""

import sys

from bitps.worker.launch.launcher import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
