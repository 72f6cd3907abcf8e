"""Tensor parallelism on the CPU (issue 32's first slice): a model split over N gloo processes computes what the whole
model computes.

- The sharding itself (models/tensor_parallel.py): a tiny random Llama (12 heads, 6 key/value heads, biases
  everywhere), cut over 2 and 3 processes that this test starts, gives the unsharded model's logits within 1e-5.
- `serve --model demo --dtype float32 --tensor-parallel 3 --device cpu` gives token for token the greedy output of
  one process with `--dtype float32` (3 prompts x 48 tokens, sent together); SIGTERM then stops every rank.
- What cannot be split or run is refused with one `error:` line, exit 2: the demo's 9 heads over 2 ranks, the
  llama.cpp runtime. `--runtime auto` picks torch.
- Faults, on a tiny model over 2 ranks: a rank killed makes the worker exit non-zero within seconds, and rank 0
  killed takes the other ranks with it.
"""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from conftest import cli, make_tiny_model
from serving import execute, free_port, launch, read_rest, running, sse_events, take_tokens
from test_load_errors import assert_error
from transformers import AutoModelForCausalLM, LlamaConfig

from rbee_worker.cli import build_parser, quantize_for, runtime_for
from rbee_worker.devices import Placement
from rbee_worker.errors import ModelLoadError
from rbee_worker.models.tensor_parallel import check_divisible, read_model_config

PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "The three most important inventions of the last century are",
    "def fibonacci(n):",
]
NEW_TOKENS = 48
CPU = torch.device("cpu")
# Run by each rank of the sharding test: rank, world, port, model directory, where rank 0 writes its logits.
RANK_SCRIPT = """
import sys, torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
from rbee_worker.engine.kv_cache import kv_shape
from rbee_worker.models.tensor_parallel import shard_model
rank, world, port, directory, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
shard_model(model, rank, world)
ids = torch.tensor([[3, 17, 101, 5, 250, 42, 7, 9, 64, 128, 1, 2]])
with torch.inference_mode():
    logits = model(input_ids=ids).logits
if rank == 0:
    torch.save({"logits": logits, "kv_shape": kv_shape(model.config)}, out)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama whose heads (12), key/value heads (6) and intermediate size (192) divide by 2 and by 3, with
    random biases on every projection (the row-parallel layers must add theirs once)."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=12,
        num_key_value_heads=6,
        max_position_embeddings=128,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(std=0.02)
    directory = tmp_path_factory.mktemp("tiny-llama-tp")
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_logits_equal_the_whole_models(tiny_llama: Path, tmp_path: Path, world: int) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.tensor([[3, 17, 101, 5, 250, 42, 7, 9, 64, 128, 1, 2]])
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
    out, port = tmp_path / "logits.pt", str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(rank), str(world), port, str(tiny_llama), str(out)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    for rank in ranks:
        _, stderr = rank.communicate(timeout=180)
        assert rank.returncode == 0, stderr
    result = torch.load(out)
    torch.testing.assert_close(result["logits"], expected, rtol=0, atol=1e-5)
    assert result["kv_shape"] == (6 // world, 8)  # the paged cache is sized for this rank's key/value heads only


def test_a_model_that_does_not_split_is_refused_naming_its_sizes() -> None:
    config, name = read_model_config("demo")
    with pytest.raises(ModelLoadError) as refused:
        check_divisible(config, 2, name)
    message = str(refused.value)
    assert "9 attention heads, 3 key/value heads and intermediate size of 1536" in message, message
    assert "attention heads and key/value heads do not" in message and "use --tensor-parallel 3" in message
    check_divisible(config, 3, name)  # no error


def test_serve_demo_over_2_ranks_exits_2_naming_the_heads() -> None:
    started = time.perf_counter()
    flags = ("--tensor-parallel", "2", "--device", "cpu", "--log-level", "warning")  # only the error on stderr
    result = cli("serve", "--model", "demo", "--port", "0", *flags, timeout=120)
    line = assert_error(result, "--tensor-parallel 2", "9 attention heads", "use --tensor-parallel 3")
    assert time.perf_counter() - started < 60, line  # refused from the config, before any rank starts


def test_llama_cpp_runtime_with_tensor_parallel_exits_2() -> None:
    result = cli("serve", "--model", "demo", "--port", "0", "--runtime", "llama.cpp", "--tp", "3", timeout=120)
    assert_error(result, "--runtime llama.cpp", "--tensor-parallel 3 cannot be honoured", "--runtime torch")


def test_auto_runtime_picks_torch_and_float_weights_under_tensor_parallel() -> None:
    args = build_parser().parse_args(["serve", "--model", "demo", "--tp", "3"])
    assert args.tensor_parallel == 3
    assert runtime_for(args, CPU) == "torch"
    assert quantize_for(args, Placement(CPU, torch.bfloat16)) == "none"


def completions(url: str) -> list[dict]:
    """The PROMPTS' greedy completions of NEW_TOKENS tokens each (EOS ignored), sent at once so that they batch."""

    def complete(prompt: str) -> dict:
        body = {"model": "demo", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0}
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
    """The worker's other ranks: its child processes running rbee_worker.engine.tp_rank."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = psutil.Process(worker_pid).children()
        pids = [c.pid for c in children if "rbee_worker.engine.tp_rank" in " ".join(c.cmdline())]
        if len(pids) == world - 1:
            return pids
        time.sleep(0.1)
    pytest.fail(f"the worker did not start {world - 1} ranks")


@pytest.mark.slow
def test_demo_over_3_ranks_gives_one_process_greedy_tokens(tmp_path: Path) -> None:
    flags = ("--dtype", "float32", "--device", "cpu", "--max-batch", "4", "--kv-cache-gb", "0.5")
    with running(tmp_path, *flags) as worker:
        alone = completions(worker.url)
    with running(tmp_path, *flags, "--tensor-parallel", "3") as worker:
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
    worker = launch(tmp_path, "--model", str(tiny_tp_model), "--tensor-parallel", "2", "--device", "cpu")
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
