"""`rbee-worker` commands as real processes forked from one that has imported the CLI's modules once.

A fresh `python -m rbee_worker` spends seconds importing torch and transformers before it reads its flags; tests that
run many short commands (tests/loading/test_load_errors.py: one per bad model) pay that once here. The zygote (this file
run as a script) imports the modules, then forks a child per command: a process of its own, with its own exit code,
stdout and stderr (stdin: /dev/null), as the real command has. Environment variables that a module reads when
imported (the Hugging Face cache's, the instruction set caps of cpu_features.force_isa_environment) would keep the
zygote's values: commands that set them run as plain processes (conftest.cli). What a fork cannot show is how long
the imports take, or what happens while they run: tests of that start plain processes.
"""

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

TIMEOUT_S = 300
# Read at import (by huggingface_hub, by rbee_worker's cpu_features and by torch and oneDNN after it), which the
# zygote has done: a fork would not see a change.
IMPORT_TIME_ENV = (
    "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE",
    "RBEE_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "TORCHINDUCTOR_CACHE_DIR",
)  # fmt: skip


class CliForks:
    """Runs commands through one zygote process; `close` ends it."""

    def __init__(self, env: dict[str, str]) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="rbee-cli-forks-"))
        self.environ = {**os.environ, "PYTHONUNBUFFERED": "1", **env}  # the zygote's, as it starts
        self._zygote = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.environ
        )
        self._count = 0
        self._lock = threading.Lock()  # one request and its answer at a time on the pipes

    def can_run(self, environ: dict[str, str]) -> bool:
        """Whether a command in this whole environment runs as it would in a fresh process: the variables read at
        import are the zygote's."""
        return all(environ.get(name) == self.environ.get(name) for name in IMPORT_TIME_ENV)

    def run(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """The command with the zygote's environment, plus `env`."""
        env = env or {}
        assert not set(env) & set(IMPORT_TIME_ENV), "run commands that set these as plain processes"
        return self._request(args, {"env": env})

    def run_in(
        self, environ: dict[str, str], args: tuple[str, ...], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """The command in the whole environment `environ` (can_run's), in this process's working directory, killed
        (SIGALRM) after `timeout` seconds."""
        assert self.can_run(environ), "run commands that change these as plain processes"
        return self._request(args, {"environ": environ, "cwd": os.getcwd(), "timeout": max(1, round(timeout))})

    def spawn(
        self, environ: dict[str, str], args: tuple[str, ...], stderr: Path, fault: str | None = None
    ) -> "ForkedProcess":
        """The command started in the whole environment `environ` (can_run's), stdout to /dev/null and stderr to the
        file `stderr`, not waited for: a Popen's view of it. `fault`: FAULT:N of tests/fault_worker.py, injected in
        the child before the command runs."""
        assert self.can_run(environ), "run commands that change these as plain processes"
        request = {"op": "spawn", "environ": environ, "cwd": os.getcwd(), "timeout": 0, "fault": fault}
        answer = self._ask({"args": list(args), "stdout": os.devnull, "stderr": str(stderr), **request})
        return ForkedProcess(self, answer["pid"], ["rbee-worker", *args])

    def _request(self, args: tuple[str, ...], fields: dict) -> subprocess.CompletedProcess[str]:
        with self._lock:
            self._count += 1
            out, err = self._dir / f"{self._count}.out", self._dir / f"{self._count}.err"
        code = self._ask({"args": list(args), "stdout": str(out), "stderr": str(err), **fields})["code"]
        return subprocess.CompletedProcess(["rbee-worker", *args], code, out.read_text(), err.read_text())

    def _ask(self, request: dict) -> dict:
        return ask_zygote(self._zygote, self._lock, request, "the CLI zygote")

    def close(self) -> None:
        assert self._zygote.stdin is not None
        self._zygote.stdin.close()
        self._zygote.wait(30)


def ask_zygote(zygote: "subprocess.Popen[str]", lock: threading.Lock, request: dict, name: str) -> dict:
    """One request to a zygote (a JSON line on its stdin) and its answer (a JSON line on its stdout), one at a time
    under `lock`; `name` says whose, should it have exited."""
    with lock:
        assert zygote.stdin is not None and zygote.stdout is not None
        zygote.stdin.write(json.dumps(request) + "\n")
        zygote.stdin.flush()
        line = zygote.stdout.readline()
        if not line:
            raise RuntimeError(f"{name} exited with {zygote.wait()}")
        return json.loads(line)


@functools.cache
def shared() -> CliForks:
    """The session's zygote, started at its first use with this process's environment then (conftest.cli's `fork`,
    serving.launch's); conftest's `close_shared_zygote` fixture ends it."""
    return CliForks({})


class ForkedProcess:
    """A spawned command as the tests use a subprocess.Popen: pid, args, poll, wait, send_signal, terminate, kill and
    returncode. Its parent is the zygote, which reaps it and answers for its exit status."""

    def __init__(self, forks: CliForks, pid: int, args: list[str]) -> None:
        self._forks = forks
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            answer = self._forks._ask({"op": "poll", "pid": self.pid})
            if "error" in answer:
                raise RuntimeError(f"the zygote cannot tell how process {self.pid} ended: {answer['error']}")
            self.returncode = answer["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not after it was reaped: its pid may be another process's by then
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _child(request: dict) -> None:
    """In the forked child: the command, as `python -m rbee_worker` runs it, then the process ends with its code."""
    from rbee_worker.cli import main

    code = 1
    try:
        # A command that hangs ends, as a plain process's timeout ends it (0: a spawned one, which its test stops).
        signal.alarm(request.get("timeout", TIMEOUT_S))
        if "environ" in request:
            os.environ.clear()
        os.environ.update(request.get("environ") or request["env"])
        if "cwd" in request:
            os.chdir(request["cwd"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # not the zygote's requests
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        if fault := request.get("fault"):  # as `python tests/fault_worker.py FAULT:N ARGS...` injects it
            import fault_worker

            name, count = fault.split(":")
            fault_worker.inject(name, int(count))
        code = main(request["args"])
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:  # as the interpreter does with an uncaught exception: its traceback, exit code 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _zygote() -> None:
    # What `generate` imports first (torch, transformers, the engine) and what `serve` imports (FastAPI, uvicorn);
    # none of them starts a thread.
    import rbee_worker.cli
    import rbee_worker.cli.generate
    import rbee_worker.server.worker  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        op = request.get("op", "run")
        if op == "poll":  # a spawned child's exit code once it has ended, else null
            try:
                pid, status = os.waitpid(request["pid"], os.WNOHANG)
                answer = {"code": os.waitstatus_to_exitcode(status) if pid else None}
            except ChildProcessError as exc:  # not a child, or already reaped
                answer = {"error": str(exc)}
            print(json.dumps(answer), flush=True)
            continue
        sys.stdout.flush()
        if (pid := os.fork()) == 0:
            _child(request)
        if op == "spawn":
            print(json.dumps({"pid": pid}), flush=True)
            continue
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    _zygote()
