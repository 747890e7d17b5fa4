"""``python -m dynstate``: the same as the ``dynstate`` command."""

# An entry point, which nothing imports: the facade stays free of the CLI.
from .cli import main

if __name__ == "__main__":
    main()
