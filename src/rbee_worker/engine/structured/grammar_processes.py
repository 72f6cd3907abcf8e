"""Grammar compilation in child processes, so that a compilation past its time limit can be stopped: xgrammar compiles
in C++, which a thread cannot interrupt, and some schemas (a long bounded repetition in a pattern, say) take minutes.

Each of a few slots is a child process that holds the tokenizer's xgrammar view and compiles one schema at a time;
the compiled grammar comes back serialized (xgrammar's CompiledGrammar.serialize_json, a few kB to a few MB, read
back in milliseconds). A compilation past the limit kills its child, and the slot starts a new one for its next
compilation. Children are forked by multiprocessing's fork server, which imports xgrammar once (2-3 s: it imports
torch), so a new child starts in tens of milliseconds and shares the server's memory; the worker's own process, with
its threads, never forks. A child dies with the fork server, which ends when the worker does.
"""

import contextlib
import ctypes
import multiprocessing
import queue
import signal
import sys
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

START_TIMEOUT_S = 300.0  # a child's start: the fork server's first start imports xgrammar and torch
_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["xgrammar"])


class CompileTimeout(Exception):
    """The compilation ran past its limit and was stopped."""


class CompileFailed(Exception):
    """xgrammar refused the schema; the message is its own."""


class CompilerProcesses:
    """`slots` child processes compiling JSON schemas against one tokenizer (xgrammar's serialized TokenizerInfo);
    `compile` may be called from that many threads at once."""

    def __init__(self, tokenizer_info_json: str, slots: int) -> None:
        self._info = tokenizer_info_json
        self._idle: queue.Queue[_Slot] = queue.Queue()
        for _ in range(slots):
            self._idle.put(_Slot())

    def compile(self, schema: str, timeout_s: float) -> str:
        """The schema compiled without free whitespace, serialized; raises CompileTimeout past `timeout_s` (the child
        is killed) and CompileFailed for a schema xgrammar refuses."""
        slot = self._idle.get()
        try:
            return slot.compile(self._info, schema, timeout_s)
        finally:
            self._idle.put(slot)

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().stop()
            except queue.Empty:
                return


class _Slot:
    def __init__(self) -> None:
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None

    def compile(self, info: str, schema: str, timeout_s: float) -> str:
        if self._process is None or not self._process.is_alive():
            self._start(info)
        assert self._conn is not None
        self._conn.send(schema)
        if not self._conn.poll(timeout_s):
            self.stop()
            raise CompileTimeout(f"took longer than {timeout_s:g} s to compile (--grammar-compile-timeout)")
        try:
            ok, text = self._conn.recv()
        except EOFError:  # killed from outside, or crashed
            self.stop()
            raise CompileFailed("the compiler process ended while compiling it") from None
        if not ok:
            raise CompileFailed(text)
        return text

    def _start(self, info: str) -> None:
        self.stop()
        ours, theirs = _context.Pipe()
        process = _context.Process(target=_serve, args=(theirs, info), name="rbee-grammar-compiler", daemon=True)
        process.start()
        theirs.close()
        self._process, self._conn = process, ours
        try:
            ready = ours.poll(START_TIMEOUT_S) and ours.recv()
        except EOFError:
            ready = False
        if not ready:
            self.stop()
            raise RuntimeError("the grammar compiler process did not start")

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None


def _serve(conn: Connection, info_json: str) -> None:
    """A child's loop: compile each schema received, answer (True, the serialized grammar) or (False, why)."""
    import xgrammar

    _die_with_parent()
    info = xgrammar.TokenizerInfo.deserialize_json(info_json)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(True)
    while True:
        try:
            schema = conn.recv()
        except EOFError:  # the worker has gone
            return
        try:
            answer = (True, compiler.compile_json_schema(schema, any_whitespace=False).serialize_json())
        except RuntimeError as exc:  # xgrammar reports every schema problem so
            answer = (False, str(exc))
        conn.send(answer)


def _die_with_parent() -> None:
    """On Linux, the kernel kills this process when its parent (the fork server) ends, even mid-compilation."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
