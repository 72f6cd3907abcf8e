"""`rbee-worker` commands as real processes forked from one that has imported the CLI's modules once.

A fresh `python -m rbee_worker` spends seconds importing torch and transformers before it reads its flags; tests that
run many short commands (tests/test_load_errors.py: one per bad model) pay that once here. The zygote (this file run
as a script) imports the modules, then forks a child per command: a process of its own, with its own exit code,
stdout and stderr, as the real command has. Environment variables that a module reads when imported (the Hugging
Face cache's) would keep the zygote's values: commands that set them run as plain processes (conftest.cli).
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# Read at import by huggingface_hub, which the zygote has imported: a fork would not see a change.
TIMEOUT_S = 300
IMPORT_TIME_ENV = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE")


class CliForks:
    """Runs commands through one zygote process; `close` ends it."""

    def __init__(self, env: dict[str, str]) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="rbee-cli-forks-"))
        self._zygote = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        )
        self._count = 0

    def run(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        env = env or {}
        assert not set(env) & set(IMPORT_TIME_ENV), "run commands that set these as plain processes"
        self._count += 1
        out, err = self._dir / f"{self._count}.out", self._dir / f"{self._count}.err"
        assert self._zygote.stdin is not None and self._zygote.stdout is not None
        request = {"args": list(args), "env": env, "stdout": str(out), "stderr": str(err)}
        self._zygote.stdin.write(json.dumps(request) + "\n")
        self._zygote.stdin.flush()
        line = self._zygote.stdout.readline()
        if not line:
            raise RuntimeError(f"the CLI zygote exited with {self._zygote.wait()}")
        code = json.loads(line)["code"]
        return subprocess.CompletedProcess(["rbee-worker", *args], code, out.read_text(), err.read_text())

    def close(self) -> None:
        assert self._zygote.stdin is not None
        self._zygote.stdin.close()
        self._zygote.wait(30)


def _child(request: dict) -> None:
    """In the forked child: the command, as `python -m rbee_worker` runs it, then the process ends with its code."""
    from rbee_worker.cli import main

    code = 1
    try:
        signal.alarm(TIMEOUT_S)  # a command that hangs ends, as conftest.cli's timeout ends a plain process
        os.environ.update(request["env"])
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        code = main(request["args"])
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _zygote() -> None:
    import rbee_worker.cli
    import rbee_worker.generate  # noqa: F401  (torch, transformers, the engine: what `generate` imports first)

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        if (pid := os.fork()) == 0:
            _child(request)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    _zygote()
