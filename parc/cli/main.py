"""The `parc` command: thin click commands over library functions.

Every ParcError becomes one line on stderr and exit code 2; nothing prints a traceback unless
PARC_DEBUG=1.
"""

from __future__ import annotations

import logging
import os
import sys

import click

from parc.errors import ParcError
from parc.version import __version__

_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class ParcGroup(click.Group):
    """Turns ParcErrors (and click usage errors) into one line and exit code 2."""

    def main(self, *args, **kwargs):  # type: ignore[override]
        kwargs.setdefault("standalone_mode", False)
        try:
            return super().main(*args, **kwargs)
        except ParcError as e:
            _fail(str(e), 2)
        except click.UsageError as e:
            if isinstance(e, _NO_ARGS_IS_HELP):
                e.show()
                sys.exit(0)
            _fail(e.format_message().splitlines()[0] if e.format_message() else "usage error", 2)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.Abort:
            _fail("aborted", 1)
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except Exception as e:  # an internal error: say so in one line
            if os.environ.get("PARC_DEBUG"):
                raise
            _fail(f"internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                  f"(PARC_DEBUG=1 shows the traceback)", 1)


def _fail(message: str, code: int) -> None:
    if os.environ.get("PARC_DEBUG") and sys.exc_info()[0] is not None:
        import traceback
        traceback.print_exc()
    click.echo(f"parc: error: {message}", err=True)
    sys.exit(code)


@click.group(cls=ParcGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="parc")
@click.option("-v", "--verbose", is_flag=True, help="Log one line per pass.")
def cli(verbose: bool) -> None:
    """parc: find and run parallel strategies for ONNX models."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="parc: %(message)s", stream=sys.stderr)


def _register() -> None:
    from parc.cli import (
        explain_cmd,
        grad_cmd,
        inspect_cmd,
        models_cmd,
        plan_cmd,
        profile_cmd,
        run_cmd,
        simulate_cmd,
    )

    cli.add_command(grad_cmd.grad)
    cli.add_command(plan_cmd.plan)
    cli.add_command(inspect_cmd.inspect)
    cli.add_command(models_cmd.models)
    cli.add_command(explain_cmd.explain)
    cli.add_command(run_cmd.run)
    cli.add_command(run_cmd.verify)
    cli.add_command(run_cmd.export)
    cli.add_command(simulate_cmd.simulate)
    cli.add_command(profile_cmd.profile)


_register()


def main() -> None:
    cli.main(prog_name="parc")


if __name__ == "__main__":
    main()
