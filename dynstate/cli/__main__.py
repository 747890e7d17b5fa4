"""``python -m dynstate.cli``: the same as the ``dynstate`` command."""

from . import main

main()
