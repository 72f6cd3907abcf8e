"""The suite's own report at the end of a run (`--file-times N`, as .ci/run passes it): the time of each test file
(pytest's durations of every setup, call and teardown, summed by file; the N slowest, 0: all), each test process's
sum, and the most memory the machine had in use while the suite ran (sampled every half second: total less
available, so every worker and engine the tests started counts, wherever it runs)."""

import collections
import threading
import time

import psutil
import pytest

SAMPLE_S = 0.5
PROCESSES_SHOWN = 6  # the largest processes at the peak, by resident memory


def _largest_processes(count: int) -> list[str]:
    """The `count` processes of the most resident memory: their size, and their command line, cut short."""
    sizes = []
    for process in psutil.process_iter(["memory_info", "cmdline"]):
        memory, command = process.info["memory_info"], process.info["cmdline"]
        if memory is not None:
            sizes.append((memory.rss, " ".join(command or [])[:100]))
    return [f"{rss / 2**30:.1f} GiB  {command}" for rss, command in sorted(sizes, reverse=True)[:count]]


class MemoryPeak:
    """The machine's memory in use, its peak and the tests that ran at that moment, from a daemon thread."""

    def __init__(self) -> None:
        self.peak = 0
        self.running_at_peak: list[str] = []
        self.largest_at_peak: list[str] = []
        self._running: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="memory-peak", daemon=True)
        self._thread.start()

    def started(self, nodeid: str) -> None:
        with self._lock:
            self._running.add(nodeid)

    def finished(self, nodeid: str) -> None:
        with self._lock:
            self._running.discard(nodeid)

    def _sample(self) -> None:
        while not self._stop.is_set():
            memory = psutil.virtual_memory()
            if (used := memory.total - memory.available) > self.peak:
                with self._lock:
                    self.peak, self.running_at_peak = used, sorted(self._running)
                self.largest_at_peak = _largest_processes(PROCESSES_SHOWN)
            self._stop.wait(SAMPLE_S)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--file-times",
        type=int,
        default=None,
        metavar="N",
        help="at the end, the N slowest test files by summed durations (0: every file), each test process's sum, "
        "and the machine's peak memory in use",
    )


def pytest_configure(config: pytest.Config) -> None:
    # In the controller only: under pytest-xdist its test processes send it their reports.
    if config.getoption("file_times") is not None and not hasattr(config, "workerinput"):
        config.pluginmanager.register(SuiteReport(config.getoption("file_times")), "suite-report")


class SuiteReport:
    """The report's plugin: the memory sampled from the start, each test's start and end, the summary."""

    def __init__(self, files: int) -> None:
        self._files = files
        self._memory = MemoryPeak()
        self._started = time.monotonic()

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self._memory.started(nodeid)

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        self._memory.finished(nodeid)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        peak, wall = self._memory.stop(), time.monotonic() - self._started
        seconds: dict[str, float] = collections.defaultdict(float)
        tests: dict[str, set[str]] = collections.defaultdict(set)
        processes: dict[str, float] = collections.defaultdict(float)
        for reports in terminalreporter.stats.values():
            for report in reports:
                if not isinstance(report, pytest.TestReport):
                    continue
                path = report.nodeid.split("::", 1)[0]
                seconds[path] += report.duration
                tests[path].add(report.nodeid)
                node = getattr(report, "node", None)  # pytest-xdist's test process
                processes[node.gateway.id if node is not None else "main"] += report.duration
        write = terminalreporter.write_line
        terminalreporter.section("time by test file")
        write(f"{'seconds':>8} {'tests':>5}  file")
        for path, total in sorted(seconds.items(), key=lambda item: -item[1])[: self._files or len(seconds)]:
            write(f"{total:8.1f} {len(tests[path]):5d}  {path}")
        count = sum(map(len, tests.values()))
        write(f"{sum(seconds.values()):8.1f} {count:5d}  all files ({wall:.0f} s of wall time)")
        write("by test process: " + ", ".join(f"{name} {total:.0f} s" for name, total in sorted(processes.items())))
        total = psutil.virtual_memory().total
        write(f"peak memory in use: {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB, while these ran:")
        for nodeid in self._memory.running_at_peak:
            write(f"  {nodeid}")
        write("the largest processes then:")
        for line in self._memory.largest_at_peak:
            write(f"  {line}")
