"""``python -m dynstate.serve URL`` — the same as ``dynstate serve URL``."""

import sys

# The one import of dynstate.cli from this package: an entry point, which nothing imports.
# Through the CLI's group, not the bare command: its errors are one line (never a
# traceback) and Ctrl-C ends it as it ends ``dynstate serve``.
from ..cli import main

if __name__ == "__main__":
    main(["serve", *sys.argv[1:]])
