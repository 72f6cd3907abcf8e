"""Command line: `rbee-worker generate`, `serve` and `bench` (flag parsing and output only; the work is elsewhere).
main runs a command and turns its failures into one line and an exit code; exits.py holds those codes, flags.py
the parser, serve.py `serve` and its checks, commands.py `generate` and `bench`, model_flags.py the runtime,
quantization and compilation that the flags pick."""

import logging
from collections.abc import Sequence

from rbee_worker.cli.exits import EXIT_FAILURE, EXIT_UNAVAILABLE, EXIT_USAGE, fail
from rbee_worker.cli.flags import build_parser
from rbee_worker.errors import BindError, GenerationError, ModelLoadError, RegistrationError
from rbee_worker.logs import configure_logging

log = logging.getLogger("rbee_worker")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        return args.run(args)
    except ModelLoadError as exc:
        if args.log_level == "debug":
            log.exception("model load failed")
        fail(str(exc), EXIT_USAGE)
    except GenerationError as exc:
        fail(str(exc), EXIT_USAGE if exc.invalid_request else EXIT_FAILURE)
    except (BindError, RegistrationError) as exc:  # the port, or the pool manager never accepted the worker
        fail(str(exc), EXIT_UNAVAILABLE)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line for the user; the traceback only when asked for
        if args.log_level == "debug":
            log.exception("unexpected failure")
        fail(f"{type(exc).__name__}: {exc} (rerun with --log-level debug for details)", EXIT_FAILURE)
