"""Quantized weights under tensor parallelism (issue 32), on the CPU.

- The cuts (loading/sharding/tp_cuts.py): a rank's part of an Int8Linear or Int4Linear (rows, or columns on whole groups
of 32)
  dequantizes to exactly that part of the whole layer's matrix; an int4 cut inside a group is refused, naming sizes.
- Shard-only int8: a rank that loads only its shard under `--quantize int8` (loading/sharding/tp_loading.py) holds
exactly the
  int8 codes and scales cut from the whole model loaded and quantized in one process: the row-parallel layers keep
  their whole rows' scales, and the LM head, which one process on CUDA quantizes, the same rows.
- Logits: `--quantize int8` / `int4` of a tiny random Llama over 2 ranks, of the demo's safetensors directory over 3
  ranks (int4: each rank quantizes the float shard it loaded alone), and the demo GGUF file's own matrices over
  3 ranks (Q4_1 layers kept as int4, and its Q8_0 embedding, tied to its LM head: one int8 matrix that both read, cut
  once), against the same load in one process. The weights are the same, but the kernels compute in bfloat16 and a
  row-parallel layer rounds N partial sums where one process rounds one, so the bound is stated against the exact
  product: the sharded model is at most twice as far from the one-process model's matrices multiplied in float32 as
  the one-process model itself is.
- `serve --model demo --quantize int4 --tensor-parallel 3` follows one process's `--quantize int4` greedy tokens,
  parting (if at all) only where one process's first two choices were nearly tied.
- `serve --quantize int4 --tensor-parallel 2` of a model whose o_proj groups the split would cut: exit 2, one line.
"""

from pathlib import Path

import pytest
import torch
from conftest import cli, make_tiny_model
from serving import running
from test_load_errors import assert_error
from test_tensor_parallel import (  # noqa: F401 -- close_script_forks: the module's fixture
    IDS,
    assert_same_tensors,
    close_script_forks,
    completions,
    sharded,
    whole_logits,
)

from rbee_worker.errors import ModelLoadError
from rbee_worker.hardware.devices import Placement
from rbee_worker.layers.int4_linear import Int4Linear
from rbee_worker.layers.int8_linear import Int8Linear
from rbee_worker.layers.quantize import quantize_head
from rbee_worker.loading.gguf.dequant import KERNEL_DTYPE, int4_affine, int8_per_row
from rbee_worker.loading.loader import load_model
from rbee_worker.loading.sharding.tp_cuts import Cut, keep_columns, keep_rows
from rbee_worker.loading.sharding.tp_layers import shard_model
from rbee_worker.loading.spec import Shard

CPU = torch.device("cpu")
NEAR_TIE = 0.5  # nats between one process's first and second choices where the split model may pick the second


def quantized_layers() -> list[torch.nn.Module]:
    """An Int8Linear and an Int4Linear (with a bias) of one random 128 x 256 matrix."""
    torch.manual_seed(0)
    weight, bias = torch.randn(128, 256), torch.randn(128)
    return [Int8Linear(*int8_per_row(weight, KERNEL_DTYPE), bias), Int4Linear(*int4_affine(weight), bias)]


@pytest.mark.parametrize("layer", quantized_layers(), ids=["int8", "int4"])
def test_a_cut_holds_exactly_its_part_of_the_quantized_matrix(layer: torch.nn.Module) -> None:
    whole = layer.dequantized(torch.float32)
    top = keep_rows(layer, 64, 64)
    assert type(top) is type(layer)
    assert torch.equal(top.dequantized(torch.float32), whole[64:])
    assert torch.equal(top.bias, layer.bias[64:])
    right = keep_columns(layer, 160, 96, "layer")
    assert torch.equal(right.dequantized(torch.float32), whole[:, 160:])
    assert right.bias is None  # a row-parallel layer adds its bias once, after the sum
    x = torch.randn(3, 256)
    parts = keep_columns(layer, 0, 160, "layer")(x[:, :160]) + right(x[:, 160:]) + layer.bias
    torch.testing.assert_close(parts, layer(x), rtol=0.02, atol=0.1)  # the kernels round their sums to bfloat16


def test_an_int4_cut_inside_a_group_is_refused() -> None:
    int4 = quantized_layers()[1]
    with pytest.raises(ModelLoadError, match="its 256 inputs split into parts of 48, which cut its groups"):
        keep_columns(int4, 48, 48, "the model's layer 0 o_proj")
    keep_columns(quantized_layers()[0], 48, 48, "int8 has no groups")  # no error


def exact_logits(spec: str, quantize: str) -> torch.Tensor:
    """The logits of IDS from MODEL loaded whole in one process with `quantize`, every quantized matrix dequantized
    and multiplied in float32: the model's exact product, without the kernels' bfloat16 rounding."""
    model = load_model(spec, Placement(CPU, torch.float32), quantize=quantize, runtime="torch").model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int4Linear | Int8Linear):
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
                linear.weight = torch.nn.Parameter(child.dequantized(torch.float32), requires_grad=False)
                linear.bias = child.bias
                setattr(parent, name, linear)
    with torch.inference_mode():
        return model(input_ids=torch.tensor(IDS)).logits


def assert_within_the_bound(spec: str, world: int, quantize: str, tmp_path: Path) -> None:
    split = sharded(spec, world, tmp_path, quantize)["logits"]
    alone, exact = whole_logits(spec, quantize), exact_logits(spec, quantize)
    own = (alone - exact).abs().max().item()
    assert own > 0, "the one-process model is expected to round (the kernels compute in bfloat16)"
    assert (split - exact).abs().max().item() <= 2 * own, ((split - exact).abs().max().item(), own)


@pytest.fixture(scope="module")
def tiny_llama_int4_shape(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path) -> Path:
    """A random Llama whose matrices quantize to int4 in whole groups of 32 inputs on each of 2 ranks."""
    directory = tmp_path_factory.mktemp("tiny-llama-quantized-tp")
    return make_tiny_model(
        directory, "llama", demo_tokenizer_dir, hidden_size=128, intermediate_size=256, num_attention_heads=4
    )


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantize_at_load_over_2_ranks(tiny_llama_int4_shape: Path, tmp_path: Path, quantize: str) -> None:
    assert_within_the_bound(str(tiny_llama_int4_shape), 2, quantize, tmp_path)


@pytest.mark.parametrize("rank", [0, 1])
def test_an_int8_shard_loaded_alone_is_the_cut_of_the_whole_int8_model(tiny_llama_int4_shape: Path, rank: int) -> None:
    spec, placement = str(tiny_llama_int4_shape), Placement(CPU, torch.float32)
    whole = load_model(spec, placement, quantize="int8", runtime="torch").model
    quantize_head(whole)  # as on CUDA (quantize_linears), where one process's head becomes int8
    shard_model(whole, rank, 2)
    alone = load_model(spec, placement, quantize="int8", runtime="torch", shard=Shard(rank, 2)).model
    quantize_head(alone)
    assert alone.tp_shard == (rank, 2)  # loaded as its shard, not whole and then cut
    o_proj = alone.model.layers[0].self_attn.o_proj.linear
    assert isinstance(o_proj, Int8Linear) and o_proj.tp_cut == Cut(1, rank * 64, 64)
    assert isinstance(alone.lm_head.linear, Int8Linear)
    assert_same_tensors(alone, whole)


def test_demo_directory_quantized_at_load_over_3_ranks(demo_hf_dir: Path, tmp_path: Path) -> None:
    """Each rank quantizes the float shard it loaded alone (loading/sharding/tp_loading.py): the same int4 groups."""
    assert_within_the_bound(str(demo_hf_dir), 3, "int4", tmp_path)


def test_demo_gguf_keeps_its_quantized_matrices_over_3_ranks(tmp_path: Path) -> None:
    assert_within_the_bound("demo", 3, "int4", tmp_path)


@pytest.mark.slow
def test_serve_demo_int4_over_3_ranks_follows_one_process_int4(tmp_path: Path) -> None:
    """The greedy tokens of one process's `--quantize int4` and of `--tensor-parallel 3`'s are the same until, if
    ever, the split model picks a token that one process ranked second, at most NEAR_TIE nats behind its first: the
    rounding of the kernels' bfloat16 sums (see the module) moves logits by less than that."""
    flags = ("--quantize", "int4", "--device", "cpu", "--max-batch", "4", "--kv-cache-gb", "0.5")
    with running(tmp_path, *flags, fork=True) as worker:
        alone = completions(worker.url, logprobs=2)
    with running(tmp_path, *flags, "--tensor-parallel", "3", fork=True) as worker:
        split = completions(worker.url)
    same = 0
    for one, three in zip(alone, split, strict=True):
        tokens = list(zip(one["logprobs"]["tokens"], three["logprobs"]["tokens"], strict=True))
        parted = next((i for i, (a, b) in enumerate(tokens) if a != b), None)
        if parted is None:
            same += 1
            continue
        ranked = one["logprobs"]["top_logprobs"][parted]
        first, second = sorted(ranked.values(), reverse=True)
        print(parted, first - second)
        assert three["logprobs"]["tokens"][parted] in ranked, (parted, ranked)
        assert first - second < NEAR_TIE, (parted, ranked)
    assert same >= 1, "every completion parted from one process's"


@pytest.fixture(scope="module")
def int4_split_inside_groups(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path) -> Path:
    """A random Llama whose o_proj has 96 inputs (groups of 32), 48 on each of 2 ranks."""
    directory = tmp_path_factory.mktemp("tiny-llama-int4-cut")
    return make_tiny_model(
        directory, "llama", demo_tokenizer_dir, hidden_size=96, num_attention_heads=6, num_key_value_heads=2
    )


def test_serve_int4_that_would_cut_its_groups_exits_2(int4_split_inside_groups: Path) -> None:
    flags = ("--quantize", "int4", "--tensor-parallel", "2", "--device", "cpu", "--log-level", "warning")
    result = cli("serve", "--model", str(int4_split_inside_groups), "--port", "0", *flags, timeout=180, fork=True)
    assert_error(result, "o_proj is int4 in groups of 32 inputs", "its 96 inputs split into parts of 48")
