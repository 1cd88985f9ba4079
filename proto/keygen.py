"""``bitps-keygen DIR [--name NAME]``: write the CURVE key pairs of docs/security.md.

The entry point only: the code is :func:`bitps.proto.keys.main`, in the library module whose
readers (and ``KeyFileError``) the shard and worker programs import, which must not import a
program.
"""

import sys

from bitps.proto.keys import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
