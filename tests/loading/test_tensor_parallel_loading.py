"""Each tensor-parallel rank loads only its shard of a safetensors directory (loading/sharding/tp_loading.py) or of a
GGUF file (gguf_model.fill_shard), issue 32.

A random Llama of about 350 MB in float32 (its embedding and LM head untied, so all but its norms split) is loaded by
a rank of 2, reading only its part of each tensor, and by one process whole: the rank's peak resident memory (the
kernel's high-water mark VmHWM, the same imports in both, after one forward has read every weight; not getrusage's
ru_maxrss, which keeps the forking test process's peak across exec) is lower by at least a quarter of the model's
size (half of it is what a rank leaves out). That the shards compute the whole model's logits is
tests/engine/test_tensor_parallel.py's (its ranks load this way), and here the demo model's safetensors directory's over
3 ranks.

A rank of the demo GGUF file builds its shard one whole layer at a time: its tensors are exactly those of the file
loaded whole in one process and cut (its Q4_1 layers kept int4 and its Q8_0 embedding tied to its head, or all
dequantized), and its peak resident memory (dequantized to float32, over 3 ranks) is lower by at least a quarter of
the model's size than one process's.
"""

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from serving import free_port
from test_tensor_parallel import (  # noqa: F401 -- close_script_forks: the module's fixture
    assert_same_tensors,
    close_script_forks,
    run_scripts,
    sharded,
    whole_logits,
)

from rbee_worker.hardware.devices import Placement
from rbee_worker.loading.loader import load_model
from rbee_worker.loading.sharding.tp_layers import shard_model
from rbee_worker.loading.spec import Shard

# Run by each process, forked from one that has imported torch and the loader (run_scripts), so that every process
# starts from the same imports: rank, world (0: the whole model in one process, no process group), port, MODEL, where
# to write the peak RSS in bytes.
RSS_SCRIPT = """
import json, os, sys, torch, torch.distributed as dist
from rbee_worker.hardware.devices import Placement
from rbee_worker.engine.parallel.rank_group import load_shard
from rbee_worker.loading.loader import load_model
from rbee_worker.loading.spec import Shard
rank, world, port, spec, out = sys.argv[1:]
rank, world = int(rank), int(world)
torch.set_num_threads(1)
shard = Shard(rank, world) if world else None
load = lambda: load_model(spec, Placement(torch.device("cpu"), torch.float32), runtime="torch", shard=shard)
if world:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    loaded, _ = load_shard(rank, world, load, "cpu")
else:
    loaded = load()
with torch.inference_mode():  # every weight read once, as serving reads them (a whole load maps its file lazily)
    loaded.model(input_ids=torch.tensor([[1, 2, 3]]))
status = open("/proc/self/status").read().split("VmHWM:")[1]
peak = int(status.split()[0]) * 1024
with open(out, "w") as file:
    json.dump({"peak": peak, "weights": loaded.info.weight_bytes}, file)
# As a rank ends (engine/parallel/rank_process.py): an interpreter's exit beside gloo's threads can abort ("terminate
# called without an active exception").
os._exit(0)
"""


@pytest.fixture(scope="module")
def mid_llama(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path) -> Path:
    """A random Llama of 88M parameters (350 MB in float32): tiny, but larger than the noise in a process's memory."""
    directory = tmp_path_factory.mktemp("mid-llama-tp")
    return make_tiny_model(
        directory,
        "llama",
        demo_tokenizer_dir,
        vocab_size=8192,  # the layers, not the embedding, make most of it (the forward's ids are below 8192)
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )


def peaks(spec: str, world: int, tmp_path: Path) -> list[dict]:
    """Each process's peak RSS and weight bytes: `world` ranks, or (0) one process loading the whole model."""
    port = str(free_port())
    outs = [tmp_path / f"rss-{world}-{rank}.json" for rank in range(max(world, 1))]
    run_scripts(RSS_SCRIPT, [[str(rank), str(world), port, spec, str(out)] for rank, out in enumerate(outs)], tmp_path)
    return [json.loads(out.read_text()) for out in outs]


@pytest.mark.parametrize(("model", "world"), [("mid_llama", 2), ("demo", 3)])
def test_a_rank_holds_less_than_the_whole_model_at_its_peak(
    model: str, world: int, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    spec = str(request.getfixturevalue(model)) if model == "mid_llama" else model
    (whole,) = peaks(spec, 0, tmp_path)
    ranks = peaks(spec, world, tmp_path)
    model_bytes = whole["weights"]
    assert model_bytes > 300e6, model_bytes
    for rank in ranks:  # its part, and the norms whole
        assert rank["weights"] < (1 / world + 0.02) * model_bytes, (rank["weights"], model_bytes)
    for rank in ranks:
        assert rank["peak"] < whole["peak"] - model_bytes / 4, (rank["peak"], whole["peak"], model_bytes)
    sizes = [round(rank["peak"] / 1e6) for rank in ranks]
    print(f"weights {model_bytes / 1e6:.0f} MB; peak RSS {whole['peak'] / 1e6:.0f} MB whole, {sizes} MB as ranks")


def test_the_demo_directory_loads_as_3_shards_that_compute_its_logits(demo_hf_dir: Path, tmp_path: Path) -> None:
    result = sharded(str(demo_hf_dir), 3, tmp_path)
    torch.testing.assert_close(result["logits"], whole_logits(str(demo_hf_dir)), rtol=0, atol=1e-4)
    assert result["kv_shape"] == (1, 64, 64)  # 3 key/value heads, one a rank


@pytest.mark.parametrize("quantize", ["int4", "none"])
def test_a_gguf_shard_loaded_alone_is_the_cut_of_the_whole_model(quantize: str) -> None:
    placement = Placement(torch.device("cpu"), torch.float32)
    whole = load_model("demo", placement, quantize=quantize, runtime="torch").model
    for rank in range(3):
        cut = copy.deepcopy(whole)
        shard_model(cut, rank, 3)
        alone = load_model("demo", placement, quantize=quantize, runtime="torch", shard=Shard(rank, 3)).model
        assert alone.tp_shard == (rank, 3)  # built as its shard, not loaded whole and then cut
        assert_same_tensors(alone, cut)
    if quantize == "int4":  # the embedding reads its tied head's int8 codes, as in one process
        assert alone.model.embed_tokens.embedding.codes.data_ptr() == alone.lm_head.linear.codes.data_ptr()
