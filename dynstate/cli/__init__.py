"""`dynstate`: inspect and maintain stores offline.

Each command opens the store, calls one or two library functions and hands plain data to
:mod:`.render` — human tables by default, ``--json`` for scripts. Failures are reported here,
in one place, as one ``error: <message>`` line. Exit codes: 0 success, 1 a failure or a
problem found, 2 a usage error.

Only click is imported at start; every library module (pyarrow, fsspec, torch...) is imported
inside the command that needs it, so ``dynstate --help`` costs a few tens of milliseconds.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from typing import Any

import click

from . import (
    commands_ls,
    commands_output,
    commands_read,
    commands_serve,
    commands_stats,
    commands_upkeep,
)
from .errors import one_line

log = logging.getLogger("dynstate")


class _Group(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)  # in the order they were added: reading first, then upkeep

    def invoke(self, ctx: click.Context) -> Any:
        from ..errors import DynstateError

        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort, SystemExit):
            raise
        except BrokenPipeError:
            # The reader went away (`dynstate ls | head`): nothing more to say to anyone, and
            # the interpreter's final flush of stdout must not fail either.
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass  # not a real file descriptor (a test runner's capture)
            ctx.exit(1)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            ctx.exit(130)
        except Exception as exc:
            # DynstateError is the expected case; anything else (a client library's error the
            # store did not translate) is still one line. The traceback only with -vv.
            kind = "failed" if isinstance(exc, DynstateError) else "failed unexpectedly"
            log.debug("command %s", kind, exc_info=True)
            url, known = ctx.meta.get("dynstate.url"), ctx.meta.get("dynstate.secrets", ())
            click.echo(f"error: {one_line(exc, url, known)}", err=True)
            ctx.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="Log more to stderr (repeat for debug).")
@click.version_option(package_name="dynstate")
@click.pass_context
def cli(ctx: click.Context, verbose: int) -> None:
    """Inspect and maintain dynstate stores: versioned Parquet shards on local disk or S3.

    Commands that delete (gc) show their plan and act only with --yes or after a yes on a
    terminal. Every command has --json.

    Exit codes: 0 success, 1 a failed command or a problem found (error on stderr),
    2 a usage error.

    \b
    Example:
      dynstate ls s3://bucket/runs/run1
    """
    if verbose:
        # For this command only: the logger is as it was afterwards (commands run in-process
        # from tests and from other programs too).
        from ..storage.credentials import Scrubber
        from .render import clean

        class _Scrubbed(Scrubber):
            """The log lines (and tracebacks) -v prints go through the one scrubber too,
            with the command's own secrets."""

            def scrub(self, text: str) -> str:
                return clean(text)

        logger = logging.getLogger("dynstate")
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler.addFilter(_Scrubbed())
        previous = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING - 10 * min(verbose, 2))

        def restore() -> None:
            logger.removeHandler(handler)
            logger.setLevel(previous)

        ctx.call_on_close(restore)


for _module in (
    commands_ls,
    commands_read,
    commands_upkeep,
    commands_output,
    commands_serve,
    commands_stats,
):
    for _command in _module.COMMANDS:
        cli.add_command(_command)


def main(args: list[str] | None = None) -> None:
    """Console-script entry point (``args``: the command line after the program's name;
    None: ``sys.argv[1:]``)."""
    try:
        cli(args=args, prog_name="dynstate")
    finally:
        # Free Arrow objects (a store and its snapshots refer to each other) while Arrow's
        # runtime is alive: left to the interpreter's teardown, a native thread pool can be
        # destroyed mid-flight and abort the process (exit 134) after correct output.
        gc.collect()
