"""The command line's exit codes, and how it ends the process: `fail` with one `error: ...` line, `exit_at_once`
without the interpreter's finalization."""

import os
import sys
from typing import NoReturn

EXIT_FAILURE, EXIT_USAGE, EXIT_UNAVAILABLE = 1, 2, 3


def fail(message: str, code: int) -> NoReturn:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)  # always one line
    sys.exit(code)


def exit_at_once(code: int) -> NoReturn:
    """End the process now, with what it printed so far flushed: for a stop signal before anything runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
