"""``python -m dynstate.serve URL`` — the same as ``dynstate serve URL``."""

# The one import of dynstate.cli from this package: an entry point, which nothing imports.
from ..cli.commands_serve import serve

if __name__ == "__main__":
    serve(prog_name="dynstate serve")
