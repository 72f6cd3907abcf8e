"""Tensor parallelism's placement, nodes and reports (issue 32), on the CPU.

- `--devices LIST`: parsed and checked (a count other than the node's ranks, a device the machine lacks, no CUDA) as
  one-line usage errors; local rank i takes the i-th listed GPU (placement only: no GPU here).
- `--nnodes` / `--node-rank`: the world spread evenly, bad combinations refused; two "nodes" on this host (two `serve`
  processes, gloo over the loopback) give token for token a single process's greedy output, a killed node 1 makes
  node 0 answer /health 503 `unhealthy` and exit non-zero within seconds, and SIGTERM to node 0 ends node 1 (exit 0,
  no process left).
- Reports: /health, the ready callback and /metrics name every rank's device and sum their memory.
"""

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import cli_forks
import httpx
import psutil
import pytest
import torch
from conftest import cli, make_tiny_model
from serving import Manager, free_port, launch, read_rest, sse_events, take_tokens
from test_load_errors import assert_error

from rbee_worker.engine.parallel.tp_messages import Topology, check_devices, parse_devices, rank_placement
from rbee_worker.hardware.devices import Placement

PROMPTS = ["Once upon a time, in a small village by the sea,", "def fibonacci(n):"]
NEW_TOKENS = 24
HIDE_CUDA = {"CUDA_VISIBLE_DEVICES": ""}


# -- --devices --------------------------------------------------------------------------------------------------------


def test_devices_are_parsed_in_order() -> None:
    assert parse_devices("2,3") == (2, 3)
    assert parse_devices("3, 0,1") == (3, 0, 1)
    for bad in ("a,b", "1,,2", "-1", "1.5", ""):
        with pytest.raises(ValueError, match="CUDA device indices"):
            parse_devices(bad)
    with pytest.raises(ValueError, match="more than once"):
        parse_devices("1,1")


def test_devices_are_checked_against_the_ranks_and_the_machine() -> None:
    check_devices((2, 3), 2, "cuda", 4)  # no error
    with pytest.raises(ValueError, match=r"names 3 GPU\(s\) for 2 rank\(s\) on this node"):
        check_devices((0, 1, 2), 2, "cuda", 4)
    with pytest.raises(ValueError, match=r"this machine has 2 CUDA device\(s\), so no cuda:3"):
        check_devices((1, 3), 2, "cuda", 2)
    with pytest.raises(ValueError, match="names CUDA GPUs, and this worker runs on cpu"):
        check_devices((0, 1), 2, "cpu", 0)


def test_each_local_rank_takes_its_listed_device() -> None:
    cuda = Placement(torch.device("cuda", 2), torch.bfloat16)
    assert [rank_placement(cuda, rank, (2, 3)).device for rank in (0, 1)] == [
        torch.device("cuda", 2),
        torch.device("cuda", 3),
    ]
    assert rank_placement(cuda, 1, (5, 0)).device == torch.device("cuda", 0)
    assert rank_placement(cuda, 1, None).device == torch.device("cuda", 3)  # from --device's index upward
    assert rank_placement(cuda, 1, (2, 3)).dtype == torch.bfloat16
    cpu = Placement(torch.device("cpu"), torch.float32)
    assert rank_placement(cpu, 2, None) == cpu


def test_the_world_spreads_over_the_nodes() -> None:
    topology = Topology(6, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500)
    assert (topology.per_node, topology.first, topology.init_method) == (3, 3, "tcp://10.0.0.1:29500")
    assert [topology.remote(rank) for rank in range(6)] == [False] * 3 + [True] * 3


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (("--tp", "3", "--devices", "0,1,2"), ("--devices 0,1,2 names CUDA GPUs", "runs on cpu")),
        (("--tp", "3", "--devices", "0,x"), ("--devices 0,x", "CUDA device indices")),
        (("--tp", "3", "--nnodes", "2"), ("--tensor-parallel 3", "--nnodes 2", "multiple of --nnodes")),
        (("--tp", "2", "--nnodes", "2", "--node-rank", "2"), ("--node-rank 2 is not below --nnodes 2",)),
    ],
    ids=["devices without CUDA", "devices not numbers", "world not divisible", "node rank too high"],
)
def test_bad_placement_flags_exit_2_with_one_line(flags: tuple[str, ...], words: tuple[str, ...]) -> None:
    flags = (*flags, "--log-level", "warning")  # only the error on stderr
    result = cli("serve", "--model", "demo", "--port", "0", *flags, timeout=120, env=HIDE_CUDA, fork=True)
    assert_error(result, *words)


# -- two nodes on one host ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tp_model(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path) -> Path:
    """A tiny random Llama (4 heads, 2 key/value heads) that splits over 2 ranks, with the demo tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-tp-nodes") / "llama", "llama", demo_tokenizer_dir)


def greedy(url: str, model: Path) -> list[list[str]]:
    """The PROMPTS' greedy tokens, one request after the other."""
    tokens = []
    for prompt in PROMPTS:
        body = {"model": str(model), "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0}
        response = httpx.post(f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=300)
        assert response.status_code == 200, response.text
        tokens.append(response.json()["choices"][0]["logprobs"]["tokens"])
    return tokens


def start_node(model: Path, rank: int, master_port: int, log: Path) -> cli_forks.ForkedProcess:
    """`serve --node-rank RANK` of a 2-node, 2-rank worker (node 0 listens where `launch` says; node 1 on no port),
    forked from the session's CLI zygote (cli_forks.shared), as `launch(..., fork=True)` starts node 0."""
    flags = ["--model", str(model), "--tp", "2", "--nnodes", "2", "--node-rank", str(rank), "--dtype", "float32"]
    flags += ["--device", "cpu", "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    log.touch()
    return cli_forks.shared().spawn({**os.environ, "PYTHONUNBUFFERED": "1"}, ("serve", *flags), log)


def node_flags(model: Path, master_port: int) -> tuple[str, ...]:
    return ("--model", str(model), "--tp", "2", "--nnodes", "2", "--node-rank", "0", "--dtype", "float32",
            "--device", "cpu", "--master-addr", "127.0.0.1", "--master-port", str(master_port))  # fmt: skip


def descendants(pid: int) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still running (not zombies) after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def test_two_nodes_give_one_process_greedy_tokens_and_stop_together(tmp_path: Path, tiny_tp_model: Path) -> None:
    alone = launch(tmp_path, "--model", str(tiny_tp_model), "--dtype", "float32", "--device", "cpu", fork=True)
    try:
        alone.wait_healthy()
        expected = greedy(alone.url, tiny_tp_model)
    finally:
        assert alone.stop() == 0, alone.stderr()
    master_port = free_port()
    node1 = start_node(tiny_tp_model, 1, master_port, tmp_path / "node1.stderr")
    node0 = launch(tmp_path, *node_flags(tiny_tp_model, master_port), fork=True)
    try:
        node0.wait_healthy()
        ranks = descendants(node1.pid)
        assert len(ranks) == 1, ranks  # node 1's rank (global rank 1); node 0 runs rank 0 itself
        assert descendants(node0.process.pid) == []
        assert greedy(node0.url, tiny_tp_model) == expected
        health = httpx.get(f"{node0.url}/health").json()
        assert health["devices"] == ["cpu", "cpu"], health
        node0.process.send_signal(signal.SIGTERM)  # drains, then stops node 1's rank with a Stop
        assert node0.process.wait(timeout=30) == 0, node0.stderr()
        assert node1.wait(timeout=15) == 0, (tmp_path / "node1.stderr").read_text()
        assert wait_gone(ranks, 5) == []
    finally:
        for process in (node0.process, node1):
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.mark.parametrize("when", ["idle", "generating", "stopped"])
def test_a_killed_node_makes_node_0_unhealthy_then_exit(tmp_path: Path, tiny_tp_model: Path, when: str) -> None:
    """Node 1 killed while node 0 idles (its next Ping fails) or in the middle of a generation (the forward's
    all-reduce fails), or its rank stopped (SIGSTOP: no connection closes, its heartbeat stops): /health 503
    `unhealthy` naming the lost rank, then exit non-zero within seconds, never a wait in a collective."""
    master_port = free_port()
    node1 = start_node(tiny_tp_model, 1, master_port, tmp_path / "node1.stderr")
    node0 = launch(tmp_path, *node_flags(tiny_tp_model, master_port), fork=True)
    ranks: list[int] = []
    try:
        node0.wait_healthy()
        ranks = descendants(node1.pid)
        seen: list[tuple[int, dict]] = []
        stop = threading.Event()

        def poll() -> None:
            with httpx.Client(base_url=node0.url, timeout=5) as http:
                while not stop.is_set():
                    try:
                        response = http.get("/health")
                    except httpx.TransportError:  # node 0 has exited
                        return
                    seen.append((response.status_code, response.json()))
                    time.sleep(0.02)

        poller = threading.Thread(target=poll)
        poller.start()
        time.sleep(2.5)  # idle past a few Pings: node 1 stays, node 0 stays healthy
        assert node1.poll() is None and node0.process.poll() is None
        killed_at = time.monotonic()
        if when == "idle":
            node1.kill()  # the node's process; its rank follows it (it watches its parent)
        elif when == "stopped":
            for pid in ranks:
                os.kill(pid, signal.SIGSTOP)
        else:
            with httpx.Client(base_url=node0.url, timeout=60) as client:
                body = {"job_id": "long", "prompt": "hi", "max_tokens": 400}
                with client.stream("POST", "/execute", json=body) as response:
                    events = sse_events(response)
                    take_tokens(events, 3)
                    killed_at = time.monotonic()
                    node1.kill()
                    terminal = read_rest(response, events).terminal
            assert terminal["type"] == "error", terminal
        code = node0.process.wait(timeout=20)
        took = time.monotonic() - killed_at
        stop.set()
        poller.join()
        assert code != 0, node0.stderr()
        assert took < (25 if when == "stopped" else 10), took  # not a collective's timeout (30 minutes)
        statuses = [(status, body.get("status")) for status, body in seen]
        assert statuses[0] == (200, "healthy")
        unhealthy = [body for status, body in seen if status == 503 and body.get("status") == "unhealthy"]
        assert unhealthy, statuses[-5:]
        expected = {"stopped": "rank 1 has sent no heartbeat", "idle": "tensor-parallel rank on another node is gone"}
        assert expected.get(when, "another node") in unhealthy[0]["message"], unhealthy[0]
        if when != "stopped":
            assert wait_gone(ranks, 5) == []
    finally:
        for pid in ranks if when == "stopped" else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for process in (node0.process, node1):
            if process.poll() is None:
                process.kill()
                process.wait()


# -- reports --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_3_way_model(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path) -> Path:
    """A tiny random Llama whose heads (6), key/value heads (3) and intermediate size (192) divide by 3, with the demo
    tokenizer and its LM head untied from the embedding."""
    directory = tmp_path_factory.mktemp("tiny-tp-3") / "llama"
    shape = {"hidden_size": 96, "intermediate_size": 192, "num_attention_heads": 6, "num_key_value_heads": 3}
    return make_tiny_model(directory, "llama", demo_tokenizer_dir, tie_word_embeddings=False, **shape)


@pytest.mark.slow
def test_health_callback_and_metrics_report_every_rank(tmp_path: Path, tiny_3_way_model: Path) -> None:
    """A tiny model over 3 ranks: /health and the ready callback name 3 devices, and their memory is the sum of the
    ranks' (the weights: the shards plus the replicated embedding and LM head, more than one process's whole model)."""
    manager = Manager([200])
    flags = ("--model", str(tiny_3_way_model), "--dtype", "float32", "--quantize", "none", "--device", "cpu")
    flags += ("--max-batch", "2", "--kv-cache-gb", "0.05")
    alone = launch(tmp_path, *flags, "--callback-url", f"{manager.url}/ready", fork=True)
    try:
        alone.wait_healthy()
        single = httpx.get(f"{alone.url}/health").json()
        assert single["devices"] == ["cpu"], single
        (one_callback,) = manager.wait_for("/ready", 1, 30)
        assert one_callback.body["devices"] == ["cpu"], one_callback.body
    finally:
        assert alone.stop() == 0, alone.stderr()
    manager.close()
    manager = Manager([200])
    worker = launch(tmp_path, *flags, "--tensor-parallel", "3", "--callback-url", f"{manager.url}/ready", fork=True)
    try:
        worker.wait_healthy(timeout=300)
        health = httpx.get(f"{worker.url}/health").json()
        (callback,) = manager.wait_for("/ready", 1, 30)
        metrics = httpx.get(f"{worker.url}/metrics").text
    finally:
        assert worker.stop() == 0, worker.stderr()
        manager.close()
    assert health["devices"] == ["cpu", "cpu", "cpu"], health
    assert callback.body["devices"] == ["cpu", "cpu", "cpu"], callback.body
    # Every rank holds the embedding and the LM head whole and a third of the layers: more than one process's
    # weights, less than three times them.
    assert single["weight_bytes"] < health["weight_bytes"] < 3 * single["weight_bytes"], (single, health)
    assert health["kv_cache_bytes"] % 3 == 0
    assert health["memory_bytes"] == health["weight_bytes"] + health["kv_cache_bytes"], health
    assert callback.body["memory_bytes"] >= health["weight_bytes"], callback.body
    assert callback.body["vram_bytes"] == 0  # a CPU
    ranks = [line for line in metrics.splitlines() if line.startswith("rbee:rank_memory_bytes{")]
    assert len(ranks) == 3, ranks
    assert all('device="cpu"' in line for line in ranks), ranks
    assert all(any(f'rank="{rank}"' in line for line in ranks) for rank in "012"), ranks
    assert sum(float(line.rsplit(" ", 1)[1]) for line in ranks) == pytest.approx(health["memory_bytes"], rel=0.01)
