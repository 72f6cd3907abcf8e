"""Shared fixtures: the real demo model, a safetensors directory built from it, tiny random-weight models, and the demo
workers that the API tests share."""

import ctypes
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import cli_forks
import httpx
import psutil
import pytest
import torch
from serving import TEST_KV_GB, Worker, launch
from xdist.scheduler import LoadScopeScheduling

from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.plan import Computed, Drawn, Executed, Plan
from rbee_worker.engine.runners.protocol import Sampled
from rbee_worker.loading.demo import cache_dir, demo_model_path
from rbee_worker.loading.gguf.llama_cpp_model import llama_cpp_installed

if TYPE_CHECKING:
    from rbee_worker.engine.sampling.sampler_state import SamplerState

needs_llama_cpp = pytest.mark.skipif(not llama_cpp_installed(), reason="llama-cpp-python is not installed")
# The runtimes that a test parametrized over them runs on (llama.cpp's where llama-cpp-python is installed). Under a
# forced instruction set (RBEE_CPU_ISA, .ci/run's second pass) only torch's: llama.cpp takes its kernels from the real
# CPU, so its runs would repeat the first pass's.
RUNTIMES = ["torch"] if os.environ.get("RBEE_CPU_ISA") else ["torch", pytest.param("llama.cpp", marks=needs_llama_cpp)]

# Bump when the way the derived directory is built changes, so stale caches are not reused.
HF_DIR_VERSION = "1"
# The bearer token of the shared demo workers (LLORCH_API_TOKEN): every client of theirs sends it.
SHARED_TOKEN = "test-token-0123456789"
# The shared workers' KV pool (GiB): the pool a machine with the memory gets by default, on llama.cpp the demo's whole
# context for each of the default 16 rows in a stream of its own (16 x 8192 x 23040 bytes, 2.81 GiB).
SHARED_KV_GB = 3
AUTH = {"Authorization": f"Bearer {SHARED_TOKEN}"}


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    return demo_model_path()


@pytest.fixture(scope="session")
def demo_hf_dir(demo_gguf: Path) -> Path:
    """The demo model as a Hugging Face safetensors directory (float32).

    The weights come from transformers' own GGUF loader, independent of ours, so comparing the two paths checks our
    dequantization; the tokenizer comes from ours (transformers' GGUF tokenizer does not split digits the way
    SmolLM2's does). Built once and cached next to the demo file.
    """
    target = cache_dir() / f"test-smollm2-hf-v{HF_DIR_VERSION}"
    if not (target / "model.safetensors").is_file():
        # A staging directory of this process's own: test processes running at once (pytest-xdist) each build one,
        # and the first to finish puts its directory in place.
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        # A separate process: transformers' GGUF path holds ~1 GB it never gives back.
        script = f"""
import torch
from transformers import AutoModelForCausalLM
from rbee_worker.loading.gguf.gguf_format import read_gguf
from rbee_worker.loading.gguf.gguf_tokenizer import build_tokenizer
path = {str(demo_gguf)!r}
model = AutoModelForCausalLM.from_pretrained({str(demo_gguf.parent)!r}, gguf_file={demo_gguf.name!r},
                                             dtype=torch.float32)
model.generation_config.eos_token_id = [2]
# The weights are dequantized already; drop the GGUF quantizer marker so that save_pretrained writes them plainly.
model.hf_quantizer = None
del model.config.quantization_config
model.save_pretrained({str(staging)!r})
build_tokenizer(read_gguf(path).metadata).save_pretrained({str(staging)!r})
"""
        subprocess.run([sys.executable, "-c", script], check=True)
        try:
            staging.replace(target)
        except OSError:  # another process put its directory in place first
            shutil.rmtree(staging)
    return target


@pytest.fixture(scope="session")
def demo_hf_bf16_dir(demo_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo directory with its weights in bfloat16, as most checkpoints on the hub are published."""
    import json

    from safetensors.torch import load_file, save_file

    target = tmp_path_factory.mktemp("demo-bf16")
    for item in demo_hf_dir.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            shutil.copy(item, target / item.name)
    weights = load_file(demo_hf_dir / "model.safetensors")
    save_file({name: t.to(torch.bfloat16) for name, t in weights.items()}, target / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    config = json.loads((demo_hf_dir / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="session")
def demo_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's tokenizer alone (3.5 MB): `RBEE_TEST_TOKENIZER_DIR` where the GGUF is not at hand (GPU box)."""
    if explicit := os.environ.get("RBEE_TEST_TOKENIZER_DIR"):
        return Path(explicit)
    from rbee_worker.loading.gguf.gguf_format import read_gguf
    from rbee_worker.loading.gguf.gguf_tokenizer import build_tokenizer

    directory = tmp_path_factory.mktemp("demo-tokenizer")
    build_tokenizer(read_gguf(demo_model_path()).metadata).save_pretrained(directory)
    return directory


def make_tiny_model(directory: Path, model_type: str, tokenizer_dir: Path, **overrides) -> Path:
    """A random-weight model of the given architecture (fixed seed), with the demo tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    config = AutoConfig.for_model(model_type, **{**shape, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def make_tiny_bert(directory: Path) -> Path:
    """A random-weight BERT encoder (fixed seed, weights spread enough that positions matter) with a WordPiece
    tokenizer of lowercase characters and a few words, which adds [CLS] and [SEP] as BERT's does."""
    import string

    from transformers import BertConfig, BertModel, BertTokenizerFast

    chars = string.ascii_lowercase + string.digits + ".,:;!?'()-"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars), "bees", "honey", "the"]
    BertTokenizerFast(vocab={token: i for i, token in enumerate(vocab)}).save_pretrained(directory)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    BertModel(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path) -> dict[str, Path]:
    """Tiny random mistral and qwen2 models (GQA, untied / tied embeddings)."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "mistral": make_tiny_model(root / "mistral", "mistral", demo_tokenizer_dir, sliding_window=None),
        "qwen2": make_tiny_model(root / "qwen2", "qwen2", demo_tokenizer_dir, tie_word_embeddings=True),
    }


def cli(
    *args: str, timeout: float = 300, env: dict[str, str] | None = None, fork: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run `rbee-worker` as a real process; `env` adds to (or overrides) this process's environment.

    fork: the process is forked from the session's CLI zygote (tests/cli_forks.py), which has imported torch and
    transformers once, saving their ~5 s of imports per command, unless `env` changes a variable read at import
    (then a fresh process, as without fork). For commands whose import time the test does not measure."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if fork and (zygote := cli_forks.shared()).can_run(full_env):
        return zygote.run_in(full_env, args, timeout)
    return subprocess.run(
        [sys.executable, "-m", "rbee_worker", *args], capture_output=True, text=True, timeout=timeout, env=full_env
    )


@pytest.fixture(scope="module", autouse=True)
def return_freed_memory() -> Iterator[None]:
    """After each module (its own engines and workers closed), the memory this process freed goes back to the
    system: glibc keeps freed heap memory for reuse, which the other test process (pytest-xdist) then cannot have."""
    yield
    gc.collect()
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture(scope="session", autouse=True)
def close_shared_zygote() -> Iterator[None]:
    """Ends the session's CLI zygote (cli_forks.shared) after the last test, if one was started."""
    yield
    if cli_forks.shared.cache_info().currsize:
        cli_forks.shared().close()


def engine_config(**fields: object) -> EngineConfig:
    """An EngineConfig of `fields` whose KV pool is TEST_KV_GB unless `fields` sizes it: no test's engine depends on
    the memory free when it starts (rows.kv_budget), which other test processes change."""
    return EngineConfig(**{"kv_cache_bytes": int(TEST_KV_GB * 2**30), **fields})  # type: ignore[arg-type]


def greedy(engine, prompt_ids: Sequence[int], max_tokens: int):
    """Greedy token ids generated through `engine` for `prompt_ids`, and the request's End event."""
    from rbee_worker.engine.request_types import End, Request, Token
    from rbee_worker.engine.sampling.sampling_params import SamplingParams

    request = Request(tuple(prompt_ids), max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))
    events = list(engine.stream(request))
    assert isinstance(events[-1], End), events[-1]
    return [i for e in events if isinstance(e, Token) for i in e.token_ids], events[-1]


def submit_together(engine, requests: Sequence, timeout: float = 120) -> list[list[int]]:
    """Submit all `requests` at once (engine.submit, no waiting in between), then each one's token ids, in order;
    every request must end with End."""
    import queue

    from rbee_worker.engine.request_types import End, Error, Token

    streams = [queue.SimpleQueue() for _ in requests]
    for request, events in zip(requests, streams, strict=True):
        engine.submit(request, events.put)
    results = []
    for events in streams:
        ids = []
        while not isinstance(event := events.get(timeout=timeout), End | Error):
            if isinstance(event, Token):
                ids.extend(event.token_ids)
        assert isinstance(event, End), event
        results.append(ids)
    return results


def run_mixed_traffic(engine, prompts: Sequence[str], stop: str | None) -> list[tuple[list[int], str]]:
    """Greedy requests of different lengths (with `stop`, one more that it ends) and a sampled one, submitted together,
    then a second wave submitted while the first still decodes: each request's (token ids, stop reason)."""
    import dataclasses
    import queue

    from rbee_worker.engine.request_types import End, Error, Request, Token
    from rbee_worker.engine.sampling.sampling_params import SamplingParams

    def requests(texts: Sequence[str], max_tokens: list[int]) -> list[Request]:
        return [Request(engine.model.tokenize(p), max_tokens=m, sampling=SamplingParams(temperature=0)) for p, m in
                zip(texts, max_tokens, strict=True)]  # fmt: skip

    first = requests(prompts, [1, 7, 32])
    first.append(
        Request(engine.model.tokenize(prompts[0]), max_tokens=16, sampling=SamplingParams(temperature=0.8), seed=5)
    )
    if stop is not None:
        first.append(dataclasses.replace(first[2], request_id="stopped", stop=(stop,)))
    second = requests(prompts[::-1], [20, 3, 17])
    streams = [queue.SimpleQueue() for _ in (*first, *second)]
    for request, events in zip(first, streams, strict=False):
        engine.submit(request, events.put)
    ids: list[list[int]] = [[] for _ in streams]
    while not ids[2]:  # the long request decodes: the second wave joins it
        if isinstance(event := streams[2].get(timeout=300), Token):
            ids[2].extend(event.token_ids)
    for request, events in zip(second, streams[len(first) :], strict=True):
        engine.submit(request, events.put)
    results = []
    for events, tokens in zip(streams, ids, strict=True):
        while not isinstance(event := events.get(timeout=300), End | Error):
            if isinstance(event, Token):
                tokens.extend(event.token_ids)
        assert isinstance(event, End), event
        results.append((tokens, event.stop_reason.value))
    return results


def assert_launched_ahead_as_waiting(waiting, ahead, prompts: Sequence[str]) -> None:
    """Requests of every kind (ending at max_tokens, at a stop string while the next step already runs, sampled,
    joining a running batch) get from `ahead`, whose decode steps are launched before the host reads the previous
    one, the tokens that `waiting` (no graphs: every step waited for) gives; and steps really ran ahead."""
    for engine in (waiting, ahead):
        engine.loaded  # noqa: B018 -- no graph capture (which bars other threads' CUDA work) while the other serves
    reference = run_mixed_traffic(waiting, prompts, stop=None)
    long_text = waiting.model.detokenize(tuple(reference[2][0]))
    stop = long_text[len(long_text) // 2 : len(long_text) // 2 + 4]  # ends a copy of the long request midway
    expected = [*reference[:4], run_mixed_traffic(waiting, prompts, stop)[4], *reference[4:]]
    assert expected[4][1] == "STOP_SEQUENCE" and len(expected[4][0]) < len(reference[2][0])
    chained: list[list[bool]] = []
    graphs = ahead._runner.graphs
    launch = graphs.launch
    graphs.launch = lambda rows, *rest: chained.append([r.chained for r in rows]) or launch(rows, *rest)
    assert run_mixed_traffic(ahead, prompts, stop) == expected
    assert any(any(rows) for rows in chained)


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether compile_model compiled `model` (the whole model or its decoder layers)."""
    return any(m._compiled_call_impl is not None for m in (model, *model.get_decoder().layers))


def penalty_state(vocab: int, generator: torch.Generator) -> tuple["SamplerState", torch.Tensor]:
    """A SamplerState of five slots, one per kind of penalty (repetition above and below 1, presence and frequency of
    both signs, none), each with 300 random prompt ids and about 1% of the vocabulary generated up to twice; and
    the slots of six rows that read it (one slot twice)."""
    from rbee_worker.engine.sampling.sampler_state import SamplerState
    from rbee_worker.engine.sampling.sampling_params import SamplingParams

    params = [
        SamplingParams(repetition_penalty=r, presence_penalty=p, frequency_penalty=f)
        for r, p, f in [(1.3, 0.0, 0.0), (0.8, 0.5, 0.2), (1.0, -1.5, 0.7), (1.1, 2.0, -0.3), (1.0, 0.0, 0.0)]
    ]
    state = SamplerState(len(params), vocab, "cpu")
    for slot, p in enumerate(params):
        state.assign(slot, p, slot, torch.randint(0, vocab, (300,), generator=generator).tolist())
    state.counts += torch.randint(0, 3, state.counts.shape, generator=generator, dtype=torch.int32) * (
        torch.rand(state.counts.shape, generator=generator) < 0.01
    )
    return state, torch.tensor([4, 2, 0, 3, 1, 2])


class SharedWorkers:
    """One `rbee-worker serve --runtime R` on the demo per runtime, with default flags but SHARED_KV_GB and
    SHARED_TOKEN, started when a test first asks for it and stopped (exit 0 on SIGTERM asserted) when the session ends.

    A start costs 5-15 s on a 2-core CPU; the API tests of several modules (test_openai, test_server,
    test_structured_output, test_tools, test_clients, test_json_bodies, test_access_log, test_load's soak) only send
    requests to a worker with default flags, and share these. Sharing is safe for them because the tests run one at a
    time and each leaves the worker idle; what a worker keeps between requests is what one module's tests already
    saw of each other: its prefix cache (compared outputs compute their prompts the same way, or come from the same
    cached state: README, Determinism), the grammar cache, and the counters of /metrics, which those tests read as
    deltas. What a fresh worker reports (the 503s while it loaded, its first /health) is kept in `loading_bodies`
    and `first_health`. A test that changes flags or the environment, kills, drains or stalls a worker, or counts
    from zero, starts its own.
    """

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._workers: dict[str, Worker] = {}
        self.first_health: dict[str, dict] = {}

    def get(self, runtime: str) -> Worker:
        worker = self._workers.get(runtime)
        if worker is None:
            flags = ("--runtime", runtime, "--kv-cache-gb", str(SHARED_KV_GB))
            worker = launch(self._log_dir, *flags, env={"LLORCH_API_TOKEN": SHARED_TOKEN}, fork=True)
            self._workers[runtime] = worker  # stopped at the end even if it never becomes healthy
            worker.wait_healthy()
            self.first_health[runtime] = httpx.get(f"{worker.url}/health", timeout=10).json()
        elif worker.process.poll() is not None:
            pytest.fail(f"the shared {runtime} worker exited with {worker.process.returncode}:\n{worker.stderr()}")
        return worker

    def close(self) -> None:
        """Stops the workers started so far (a later `get` starts a new one)."""
        workers, self._workers = self._workers, {}
        codes = {runtime: worker.stop() for runtime, worker in workers.items()}
        failed = {runtime: code for runtime, code in codes.items() if code != 0}
        assert not failed, "\n".join(f"{r}: exit {c}\n{workers[r].stderr()}" for r, c in failed.items())


SHARED_WORKERS = pytest.StashKey[SharedWorkers]()


@pytest.fixture(scope="session")
def shared_workers(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedWorkers]:
    workers = pytestconfig.stash[SHARED_WORKERS] = SharedWorkers(tmp_path_factory.mktemp("shared-workers"))
    try:
        yield workers
    finally:
        workers.close()


pytest_plugins = ["suite_report"]
# The modules whose tests use the shared workers: under pytest-xdist they run in one test process, which starts the
# shared workers once (ModuleScheduling; pytest_collection_modifyitems checks that the list is whole).
SHARED_MODULES = frozenset(
    {
        "test_access_log.py",
        "test_clients.py",
        "test_embeddings.py",
        "test_json_bodies.py",
        "test_load.py",
        "test_openai.py",
        "test_server.py",
        "test_structured_output.py",
        "test_tools.py",
    }
)


class ModuleScheduling(LoadScopeScheduling):
    """pytest-xdist's `--dist loadscope` (./dev test), a test module being a scope, so that its module-scoped workers
    and engines start once, and the modules of SHARED_MODULES one scope. The controller knows the tests by their ids
    alone, hence a list of module names."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return "shared-workers" if Path(path).name in SHARED_MODULES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> ModuleScheduling | None:
    return ModuleScheduling(config, log) if config.getoption("dist") == "loadscope" else None


def pytest_configure(config: pytest.Config) -> None:
    """In each of pytest-xdist's test processes (`./dev test` runs two), the forwards take the cores' share of one
    process: torch's threads here, and through OMP_NUM_THREADS those of every worker and engine started here
    (engine/engine_config.py default_threads), so that two processes' llama.cpp threads never outnumber the cores (they
    spin at each operation's barrier)."""
    if (processes := os.environ.get("PYTEST_XDIST_WORKER_COUNT")) is None:
        return
    threads = max(1, (psutil.cpu_count(logical=False) or 1) // int(processes))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test of SHARED_MODULES in this process (they run one after another), the shared workers stop:
    under pytest-xdist the process goes on with other modules, which then run without their memory."""
    leaving = item.path.name in SHARED_MODULES and (nextitem is None or nextitem.path.name not in SHARED_MODULES)
    if leaving and (workers := item.config.stash.get(SHARED_WORKERS, None)) is not None:
        workers.close()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules with tests that use the shared workers run last, one after another, each in its own order: the
    shared workers (about 4.5 GiB resident together, most of it llama.cpp's KV cache) then live from the first of
    them to the session's end, not beside every other module's workers. Each such module must be in SHARED_MODULES."""
    sharing = {item.path for item in items if "shared_workers" in getattr(item, "fixturenames", ())}
    if missing := sorted(path.name for path in sharing if path.name not in SHARED_MODULES):
        raise pytest.UsageError(f"tests/conftest.py: add {', '.join(missing)} to SHARED_MODULES")
    items[:] = [item for item in items if item.path not in sharing] + [item for item in items if item.path in sharing]


def default_runtime() -> str:
    """What `--runtime auto` picks for the demo GGUF on the CPU: llama.cpp where llama-cpp-python is installed."""
    return "llama.cpp" if llama_cpp_installed() else "torch"


def executed(plan: Plan, token: int = 1) -> Executed:
    """What the executor gives back for a plan, without a model: every chunk computed; a chunk that samples and every
    decode row give `token`."""
    out: Executed = []
    for forward in plan.forwards:
        out += [Computed(c) for c in forward.chunks]
        out += [Drawn(c.sequence, Sampled((token,), True)) for c in forward.chunks if c.samples]
        out += [Drawn(d.sequence, Sampled((token,), True), d) for d in forward.decode]
    return out
