"""`rbee-worker generate` and `bench`: their usage checks, then the modules that do the work, imported only then."""

import argparse

from rbee_worker.cli.exits import EXIT_USAGE, fail
from rbee_worker.cli.model_flags import check_runtime_flags


def run_bench(args: argparse.Namespace) -> int:
    from rbee_worker.benchmark.run import main  # httpx and the load generator only when benchmarking

    return main(args)


def run_generate(args: argparse.Namespace) -> int:
    # Checked before the heavy imports, so a typo fails at once.
    if len(args.stop) > 4 or any(not s or len(s.encode()) > 100 for s in args.stop):
        fail("--stop takes at most 4 strings, each 1..100 UTF-8 bytes", EXIT_USAGE)
    check_runtime_flags(args)
    from rbee_worker.cli.generate import generate

    return generate(args)
