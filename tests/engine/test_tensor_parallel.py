"""Tensor parallelism on the CPU (issue 32's first slice): a model split over N gloo processes computes what the whole
model computes.

- The sharding itself (loading/sharding/tp_layers.py), each rank loading as a worker's rank does: a tiny random Llama
(12
  heads, 6 key/value heads, biases everywhere, a vocabulary that splits into padded shards), cut over 2 and 3
  processes that this test starts, gives the unsharded model's logits within 1e-5; so does a tiny Qwen2 with 2
  key/value heads over 4 ranks (each replicated on 2) and a tied LM head, whose `serve --tensor-parallel 4` gives
  one process's greedy tokens.
- `serve --model demo --dtype float32 --tensor-parallel 3 --device cpu` gives token for token the greedy output of
  one process with `--dtype float32` (3 prompts x 48 tokens, sent together); SIGTERM then stops every rank.
- What cannot be split or run is refused with one `error:` line, exit 2: the demo's 9 heads over 2 ranks, the
  llama.cpp runtime. `--runtime auto` picks torch.
- Faults, on a tiny model over 2 ranks: a rank killed makes the worker exit non-zero within seconds, and rank 0
  killed takes the other ranks with it.
"""

import concurrent.futures
import functools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from cli_forks import ask_zygote
from conftest import cli, make_tiny_model
from serving import execute, free_port, launch, read_rest, running, sse_events, take_tokens
from test_architectures import CASES as ARCHITECTURES
from test_architectures import SPREAD
from test_load_errors import assert_error
from transformers import AutoModelForCausalLM

from rbee_worker.cli.flags import build_parser
from rbee_worker.cli.model_flags import resolve_model
from rbee_worker.errors import ModelLoadError
from rbee_worker.hardware.devices import Placement
from rbee_worker.loading.loader import load_model, probe_model, read_model_config
from rbee_worker.loading.sharding.tp_layers import VocabShard, check_divisible

PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "The three most important inventions of the last century are",
    "def fibonacci(n):",
]
NEW_TOKENS = 48
CPU = torch.device("cpu")
IDS = [[3, 17, 101, 5, 250, 42, 7, 9, 64, 128, 1, 2, 49000, 16400]]  # ids in every vocabulary shard of 2, 3 and 4
# Run by each rank of the sharding tests: rank, world, port, MODEL, --quantize, where rank 0 writes its logits. The
# rank loads and cuts its shard as a worker's rank does (rank_group.load_shard), then runs the whole model.
RANK_SCRIPT = f"""
import sys, torch, torch.distributed as dist
from rbee_worker.hardware.devices import Placement
from rbee_worker.engine.runners.torch.kv_cache import kv_shape
from rbee_worker.engine.parallel.rank_group import load_shard
from rbee_worker.loading.loader import load_model
from rbee_worker.loading.spec import Shard
rank, world, port, spec, quantize, out = sys.argv[1:]
rank, world = int(rank), int(world)
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=world)
placement, shard = Placement(torch.device("cpu"), torch.float32), Shard(rank, world)
load = lambda: load_model(spec, placement, quantize=quantize, runtime="torch", shard=shard)
loaded, _ = load_shard(rank, world, load, "cpu")
with torch.inference_mode():
    logits = loaded.model(input_ids=torch.tensor({IDS})).logits
if rank == 0:
    torch.save({{"logits": logits, "kv_shape": kv_shape(loaded.model.config)}}, out)
dist.destroy_process_group()
"""


# A process that imports what the rank scripts import (torch, torch.distributed, the loader), then forks a child per
# request that runs the request's script with its arguments as sys.argv[1:]: each child is a fresh process of its own
# (its own pid, memory and process group), without importing torch again. Requests and answers are JSON lines; the
# zygote ends when its stdin closes.
SCRIPT_ZYGOTE = """
import json, os, sys, traceback
import torch, torch.distributed
from rbee_worker.hardware.devices import Placement
from rbee_worker.engine.runners.torch.kv_cache import kv_shape
from rbee_worker.engine.parallel.rank_group import load_shard
from rbee_worker.loading.loader import load_model

def child(request):
    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDWR), 0)
        os.dup2(os.open(os.devnull, os.O_RDWR), 1)
        os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        sys.argv = ["-c", *request["args"]]
        exec(compile(request["script"], "<script>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

for line in sys.stdin:
    request = json.loads(line)
    if "pid" in request:  # its exit code once it has ended, else null
        pid, status = os.waitpid(request["pid"], os.WNOHANG)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status) if pid else None}), flush=True)
        continue
    sys.stdout.flush()
    if (pid := os.fork()) == 0:
        child(request)
    print(json.dumps({"pid": pid}), flush=True)
"""


class ScriptForks:
    """Runs scripts as processes forked from one zygote (SCRIPT_ZYGOTE) that has imported torch and the loader once,
    for scripts whose imports are not what a test checks; `close` ends it."""

    def __init__(self) -> None:
        self._zygote = subprocess.Popen(
            [sys.executable, "-c", SCRIPT_ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._lock = threading.Lock()  # one request and its answer at a time on the pipes

    def _ask(self, request: dict) -> dict:
        return ask_zygote(self._zygote, self._lock, request, "the script zygote")

    def start(self, script: str, args: list[str], stderr: Path) -> int:
        """The pid of a child running `script` with `args`, its stderr written to the file `stderr`."""
        return self._ask({"script": script, "args": args, "stderr": str(stderr)})["pid"]

    def wait(self, pid: int, timeout: float) -> int:
        """The child's exit code once it has ended; it is killed after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (code := self._ask({"pid": pid})["code"]) is None:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"script process {pid} still ran after {timeout:.0f} s")
            time.sleep(0.05)
        return code

    def close(self) -> None:
        """Ends the zygote at once: it holds no state, and its interpreter's shutdown (torch's) is slow."""
        assert self._zygote.stdin is not None
        self._zygote.stdin.close()
        self._zygote.kill()
        self._zygote.wait()


@functools.cache
def script_forks() -> ScriptForks:
    """The zygote of the modules that run rank scripts (sharded, test_tensor_parallel_loading's peaks), started at
    its first use; each such module's `close_script_forks` ends it after the module's last test."""
    return ScriptForks()


@pytest.fixture(scope="module", autouse=True)
def close_script_forks() -> Iterator[None]:
    """Ends the script zygote after the module's tests, if they started one: it holds torch's memory while it lives."""
    yield
    if script_forks.cache_info().currsize:
        script_forks().close()
        script_forks.cache_clear()


def run_scripts(script: str, argv: list[list[str]], tmp_path: Path, timeout: float = 300) -> None:
    """`script` in one forked process per entry of `argv` (its arguments), all at once; each must exit 0. Where one
    fails, the others (which may wait for it in a collective) are killed."""
    forks = script_forks()
    logs = [tmp_path / f"script-{i}-{uuid.uuid4().hex[:6]}.stderr" for i in range(len(argv))]
    pids = [forks.start(script, args, log) for args, log in zip(argv, logs, strict=True)]
    running = set(pids)
    deadline = time.monotonic() + timeout
    try:
        for pid, log in zip(pids, logs, strict=True):
            code = forks.wait(pid, max(1.0, deadline - time.monotonic()))
            running.discard(pid)
            assert code == 0, log.read_text(errors="replace")
    finally:
        for pid in running:
            os.kill(pid, signal.SIGKILL)
            forks.wait(pid, 30)


def whole_logits(spec: str, quantize: str = "none") -> torch.Tensor:
    """The logits of IDS from MODEL loaded whole in one process, in float32 (as the ranks load it)."""
    loaded = load_model(spec, Placement(CPU, torch.float32), quantize=quantize, runtime="torch")
    with torch.inference_mode():
        return loaded.model(input_ids=torch.tensor(IDS)).logits


def assert_same_tensors(loaded: torch.nn.Module, expected: torch.nn.Module) -> None:
    """Both models hold the same tensors (parameters and buffers) under the same names, equal in dtype and value."""
    tensors, expected_tensors = loaded.state_dict(), expected.state_dict()
    assert tensors.keys() == expected_tensors.keys()
    for key, tensor in expected_tensors.items():
        assert tensors[key].dtype == tensor.dtype and torch.equal(tensors[key], tensor), key


def sharded(spec: str, world: int, tmp_path: Path, quantize: str = "none") -> dict:
    """Rank 0's logits of IDS and its KV cache's shape, from MODEL cut over `world` gloo processes."""
    out, port = tmp_path / "logits.pt", str(free_port())
    run_scripts(
        RANK_SCRIPT, [[str(rank), str(world), port, spec, quantize, str(out)] for rank in range(world)], tmp_path
    )
    return torch.load(out)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path) -> Path:
    """A random Llama whose heads (12), key/value heads (6) and intermediate size (192) divide by 2 and by 3, with
    random biases on every projection (the row-parallel layers must add theirs once), and a vocabulary of 49160,
    which splits into neither 2 nor 3 shards of whole blocks of 64 (padded)."""
    directory = make_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-tp"),
        "llama",
        demo_tokenizer_dir,
        vocab_size=49160,
        hidden_size=96,
        intermediate_size=192,
        num_attention_heads=12,
        num_key_value_heads=6,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(std=0.02)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_qwen2_2_kv_heads(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path) -> Path:
    """A random Qwen2 with 8 attention heads and 2 key/value heads (so over 4 ranks each key/value head is on 2),
    its LM head tied to the embedding, and a vocabulary of 49160 (4 shards of 12352, padded)."""
    directory = tmp_path_factory.mktemp("tiny-qwen2-tp")
    shape = {"num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 49160}
    return make_tiny_model(directory, "qwen2", demo_tokenizer_dir, tie_word_embeddings=True, **shape)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_logits_equal_the_whole_models(tiny_llama: Path, tmp_path: Path, world: int) -> None:
    result = sharded(str(tiny_llama), world, tmp_path)
    torch.testing.assert_close(result["logits"], whole_logits(str(tiny_llama)), rtol=0, atol=1e-5)
    assert result["kv_shape"] == (6 // world, 8, 8)  # the paged cache is sized for this rank's key/value heads only


def test_key_value_heads_fewer_than_ranks_are_replicated(tiny_qwen2_2_kv_heads: Path, tmp_path: Path) -> None:
    result = sharded(str(tiny_qwen2_2_kv_heads), 4, tmp_path)
    torch.testing.assert_close(result["logits"], whole_logits(str(tiny_qwen2_2_kv_heads)), rtol=0, atol=1e-5)
    assert result["kv_shape"] == (1, 8, 8)  # one key/value head on each rank


def test_serve_over_4_ranks_with_2_key_value_heads_gives_one_process_tokens(
    tiny_qwen2_2_kv_heads: Path, tmp_path: Path
) -> None:
    """Through the engine (its attention, the paged KV cache of one key/value head a rank, the padded vocabulary)."""
    alone, split = served_alone_and_split(str(tiny_qwen2_2_kv_heads), 4, tmp_path)
    assert split == alone


def test_the_vocabulary_splits_into_padded_shards() -> None:
    assert [(VocabShard(49160, rank, 3).start, VocabShard(49160, rank, 3).size) for rank in range(3)] == [
        (0, 16448),
        (16448, 16448),
        (32896, 16448),
    ]
    assert VocabShard(49152, 1, 3).size == 16384  # no padding where whole blocks of 64 divide


def test_a_model_that_does_not_split_is_refused_naming_its_sizes() -> None:
    config, name = read_model_config(probe_model("demo", Placement(CPU, torch.float32)))
    with pytest.raises(ModelLoadError) as refused:
        check_divisible(config, 2, name)
    message = str(refused.value)
    assert "9 attention heads and intermediate size of 1536 must each divide by 2" in message, message
    assert "3 key/value heads divide by 2 or into it" in message, message
    assert "attention heads and key/value heads do not" in message and "use --tensor-parallel 3" in message
    check_divisible(config, 3, name)  # no error
    config.num_attention_heads, config.num_key_value_heads, config.intermediate_size = 8, 2, 64
    check_divisible(config, 4, name)  # 2 key/value heads over 4 ranks: each replicated on 2
    with pytest.raises(ModelLoadError, match="its attention heads do not"):
        check_divisible(config, 16, name)  # 8 query heads do not divide by 16
    config.num_attention_heads, config.num_key_value_heads, config.intermediate_size = 12, 4, 96
    with pytest.raises(ModelLoadError, match="its key/value heads do not"):
        check_divisible(config, 6, name)  # 4 key/value heads neither divide by 6 nor into it


def test_serve_demo_over_2_ranks_exits_2_naming_the_heads() -> None:
    started = time.perf_counter()
    flags = ("--tensor-parallel", "2", "--device", "cpu", "--log-level", "warning")  # only the error on stderr
    result = cli("serve", "--model", "demo", "--port", "0", *flags, timeout=120, fork=True)
    line = assert_error(result, "--tensor-parallel 2", "9 attention heads", "use --tensor-parallel 3")
    assert time.perf_counter() - started < 60, line  # refused from the config, before any rank starts


def test_llama_cpp_runtime_with_tensor_parallel_exits_2() -> None:
    result = cli("serve", "--model", "demo", "--port", "0", "--runtime", "llama.cpp", "--tp", "3", timeout=120)
    assert_error(result, "--runtime llama.cpp", "--tensor-parallel 3 cannot be honoured", "--runtime torch")


def test_auto_runtime_picks_torch_and_float_weights_under_tensor_parallel() -> None:
    args = build_parser().parse_args(["serve", "--model", "demo", "--tp", "3"])
    assert args.tensor_parallel == 3
    model = resolve_model(args, Placement(CPU, torch.bfloat16))
    assert (model.runtime, model.quantize) == ("torch", "none")


def served_alone_and_split(model: str, world: int, tmp_path: Path) -> tuple[list[list[str]], list[list[str]]]:
    """The greedy tokens of `completions` from MODEL served (float32, CPU) by one process, then over `world` ranks."""
    flags = ("--model", model, "--dtype", "float32", "--device", "cpu", "--max-batch", "4", "--kv-cache-gb", "0.1")
    tokens = []
    for parallel in ((), ("--tensor-parallel", str(world))):
        with running(tmp_path, *flags, *parallel, fork=True) as worker:
            tokens.append([c["logprobs"]["tokens"] for c in completions(worker.url, model=model)])
    return tokens[0], tokens[1]


def completions(url: str, logprobs: int = 0, model: str = "demo") -> list[dict]:
    """The PROMPTS' greedy completions of NEW_TOKENS tokens each (EOS ignored) from MODEL, sent at once so that they
    batch, with the `logprobs` most likely tokens at each position."""

    def complete(prompt: str) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": logprobs}
        response = httpx.post(f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=600)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert len(choice["logprobs"]["tokens"]) == NEW_TOKENS, choice
        return choice

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(complete, PROMPTS))


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def rank_pids(worker_pid: int, world: int, timeout: float = 30) -> list[int]:
    """The worker's other ranks: its child processes running rbee_worker.engine.parallel.rank_process."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = psutil.Process(worker_pid).children()
        pids = [c.pid for c in children if "rbee_worker.engine.parallel.rank_process" in " ".join(c.cmdline())]
        if len(pids) == world - 1:
            return pids
        time.sleep(0.1)
    pytest.fail(f"the worker did not start {world - 1} ranks")


@pytest.mark.slow
def test_demo_over_3_ranks_gives_one_process_greedy_tokens(tmp_path: Path) -> None:
    flags = ("--dtype", "float32", "--device", "cpu", "--max-batch", "4", "--kv-cache-gb", "0.5")
    with running(tmp_path, *flags, fork=True) as worker:
        alone = completions(worker.url)
    with running(tmp_path, *flags, "--tensor-parallel", "3", fork=True) as worker:
        pids = rank_pids(worker.process.pid, 3)
        split = completions(worker.url)
        health = httpx.get(f"{worker.url}/health").json()
        assert health["runtime"] == "torch", health
    for one, three in zip(alone, split, strict=True):
        assert three["logprobs"]["tokens"] == one["logprobs"]["tokens"]
        assert three["text"] == one["text"]
        pairs = zip(one["logprobs"]["token_logprobs"], three["logprobs"]["token_logprobs"], strict=True)
        diffs = [abs(a - b) for a, b in pairs]
        assert max(diffs) < 1e-3, diffs
    deadline = time.monotonic() + 10  # SIGTERM (running's exit) stopped rank 0; its ranks go with it
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in pids), [pid for pid in pids if not gone(pid)]


@pytest.fixture(scope="module")
def tiny_tp_model(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path) -> Path:
    """A tiny random Llama that splits over 2 ranks, with the demo tokenizer: quick to load for the fault tests."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-tp") / "llama", "llama", demo_tokenizer_dir)


@pytest.mark.parametrize("killed", ["rank 1 idle", "rank 1 generating", "rank 0", "SIGTERM to every rank"])
def test_a_rank_that_dies_ends_the_whole_worker(tmp_path: Path, tiny_tp_model: Path, killed: str) -> None:
    worker = launch(tmp_path, "--model", str(tiny_tp_model), "--tensor-parallel", "2", "--device", "cpu", fork=True)
    try:
        worker.wait_healthy()
        (rank1,) = rank_pids(worker.process.pid, 2)
        with httpx.Client(base_url=worker.url, timeout=60) as client:
            assert execute(client, prompt="hi", max_tokens=4).terminal["type"] == "end"
            if killed == "SIGTERM to every rank":  # as a supervisor stopping the process group: rank 0 drains
                os.kill(rank1, signal.SIGTERM)
                worker.process.send_signal(signal.SIGTERM)
                assert worker.process.wait(timeout=30) == 0, worker.stderr()
                deadline = time.monotonic() + 10
                while not gone(rank1) and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert gone(rank1), "rank 1 outlived rank 0"
                return
            if killed == "rank 0":
                worker.process.kill()
                worker.process.wait(timeout=10)
                deadline = time.monotonic() + 10
                while not gone(rank1) and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert gone(rank1), "rank 1 outlived rank 0"
                return
            if killed == "rank 1 idle":
                os.kill(rank1, signal.SIGKILL)
            else:  # in the middle of a generation: rank 0 must not hang in an all-reduce
                body = {"job_id": "long", "prompt": "hi", "max_tokens": 400}
                with client.stream("POST", "/execute", json=body) as response:
                    events = sse_events(response)
                    take_tokens(events, 3)
                    os.kill(rank1, signal.SIGKILL)
                    terminal = read_rest(response, events).terminal
                assert terminal["type"] == "error", terminal
        code = worker.process.wait(timeout=20)  # within seconds, not at a collective's timeout
        assert code != 0, worker.stderr()
        assert "tensor-parallel rank 1" in worker.stderr()
    finally:
        if worker.process.poll() is None:
            worker.process.kill()
            worker.process.wait()


@pytest.mark.parametrize("case", ["mistral", "qwen2"])
def test_sliding_windows_over_2_ranks_give_one_process_tokens(
    case: str, tmp_path: Path, demo_tokenizer_dir: Path
) -> None:
    """Sliding layers under tensor parallelism, each rank's heads over the same window (Mistral's on every layer,
    Qwen2's upper layers), through serve, against one process (which tests/engine/test_architectures.py holds to
    transformers). (Gemma and gpt-oss are not cut: their scaled embeddings and experts are refused at load.)"""
    model_type, overrides = ARCHITECTURES[case]
    model = str(make_tiny_model(tmp_path / case, model_type, demo_tokenizer_dir, **{**SPREAD, **overrides}))
    alone, split = served_alone_and_split(model, 2, tmp_path)
    assert split == alone
