"""``python -m dynstate.serve URL`` — the same as ``dynstate serve URL``."""

from .command import serve

if __name__ == "__main__":
    serve(prog_name="dynstate serve")
