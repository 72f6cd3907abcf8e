"""Every bad model, device or flag reaches the user as one line `error: ...` on stderr, exit code 2, nothing on stdout.

Each case runs the real CLI in its own process, forked from one that has imported it once (tests/cli_forks.py). The
broken models are built cheaply: small files are copied from the demo safetensors directory and its weights are
symlinked, so nearly every case fails before any weights load.
"""

import functools
import json
import os
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import psutil
import pytest
import torch
from cli_forks import IMPORT_TIME_ENV, CliForks
from conftest import cli, make_tiny_bert, make_tiny_model, needs_llama_cpp
from safetensors.torch import load_file, save_file

from rbee_worker.loading.gguf.llama_cpp_model import llama_cpp_installed

# Hide any GPU from the CLI processes so the device cases give the same answer on a CUDA machine as on this one.
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@functools.cache
def forks() -> CliForks:
    return CliForks(NO_GPU)


@pytest.fixture(scope="module", autouse=True)
def close_forks() -> Iterator[None]:
    yield
    if forks.cache_info().currsize:
        forks().close()


def generate(model: Path | str, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`rbee-worker generate` in a process of its own: forked from one that has imported the CLI once (cli_forks.py),
    or started afresh where `env` sets what a module reads when imported."""
    args = ("generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "2", *flags)
    if env and set(env) & set(IMPORT_TIME_ENV):
        return cli(*args, env=env)
    return forks().run(*args, env=env)


def assert_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The contract: exit 2, one `error: ` line on stderr naming every needle (case-insensitive), empty stdout."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{result.stderr}"
    line = lines[0]
    assert line.startswith("error: "), line
    assert result.returncode == 2, f"exit code {result.returncode}: {line}"
    assert result.stdout == "", result.stdout
    for needle in needles:
        assert needle.lower() in line.lower(), f"{needle!r} not in {line!r}"
    # One readable line, not a dump of everything transformers knows.
    assert len(line) < 500, line
    return line


def hf_copy(demo_hf_dir: Path, target: Path, *, weights: bool = True, tokenizer: bool = True) -> Path:
    """A copy of the demo safetensors directory made of its small files, the weights symlinked rather than copied."""
    target.mkdir()
    copy_small_files(
        demo_hf_dir, target, ("config.json", "generation_config.json", *(TOKENIZER_FILES if tokenizer else ()))
    )
    if weights:
        (target / "model.safetensors").symlink_to(demo_hf_dir / "model.safetensors")
    return target


def copy_small_files(source: Path, target: Path, names: tuple[str, ...]) -> None:
    for name in names:
        if (source / name).is_file():
            shutil.copy(source / name, target / name)


def safetensors_header(path: Path) -> bytes:
    """The 8-byte length and JSON header of a safetensors file: everything but the tensor data."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return struct.pack("<Q", length) + f.read(length)


def write_config(directory: Path, **fields: object) -> Path:
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(fields))
    return directory


# 1-3: paths that are not model directories


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    assert_error(generate(missing), str(missing), "does not exist")


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("not a model")
    assert_error(generate(tmp_path), str(tmp_path), "config.json")


def test_directory_without_weights(tmp_path: Path, demo_hf_dir: Path) -> None:
    model = hf_copy(demo_hf_dir, tmp_path / "model", weights=False)
    assert_error(generate(model), str(model), "no weights", "safetensors")


def test_directory_with_only_pytorch_bin(tmp_path: Path, demo_hf_dir: Path) -> None:
    model = hf_copy(demo_hf_dir, tmp_path / "model", weights=False)
    (model / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not read")  # never unpickled: .bin is refused by name
    assert_error(generate(model), str(model), ".bin", "safetensors")


# 4: tokenizer


def test_missing_tokenizer(tmp_path: Path, demo_hf_dir: Path) -> None:
    model = hf_copy(demo_hf_dir, tmp_path / "model", tokenizer=False)
    assert_error(generate(model), str(model), "tokenizer")


def test_malformed_tokenizer(tmp_path: Path, demo_hf_dir: Path) -> None:
    model = hf_copy(demo_hf_dir, tmp_path / "model")
    # Valid JSON that the tokenizers library rejects with a bare Exception.
    broken = json.loads((demo_hf_dir / "tokenizer.json").read_text())
    broken["model"] = {"type": "NoSuchModel"}
    (model / "tokenizer.json").write_text(json.dumps(broken))
    assert_error(generate(model), str(model), "tokenizer", "copy the model's original tokenizer files")


def test_invalid_generation_config(tmp_path: Path, demo_hf_dir: Path) -> None:
    model = hf_copy(demo_hf_dir, tmp_path / "model")
    (model / "generation_config.json").write_text("{eos_token_id: 2")
    assert_error(generate(model), "generation_config.json", str(model))


# 5-6: damaged weights


def test_corrupt_safetensors_header(tmp_path: Path, demo_hf_dir: Path) -> None:
    model = hf_copy(demo_hf_dir, tmp_path / "model", weights=False)
    (model / "model.safetensors").write_bytes(b"\xff" * 8 + b"this is no JSON header" * 10)
    assert_error(generate(model), "model.safetensors", "corrupt")


def test_truncated_safetensors(tmp_path: Path, demo_hf_dir: Path) -> None:
    source = demo_hf_dir / "model.safetensors"
    model = hf_copy(demo_hf_dir, tmp_path / "model", weights=False)
    # Half the size of the real file: its real header followed by a sparse hole, so nothing large is written.
    shard = model / "model.safetensors"
    shard.write_bytes(safetensors_header(source))
    os.truncate(shard, source.stat().st_size // 2)
    assert_error(generate(model), "model.safetensors", "truncated")


def test_sharded_index_with_missing_shard(tmp_path: Path, demo_hf_dir: Path) -> None:
    model = hf_copy(demo_hf_dir, tmp_path / "model", weights=False)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    (model / first).symlink_to(demo_hf_dir / "model.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": first, "model.norm.weight": second}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_error(generate(model), second, "missing", "model.safetensors.index.json")


def test_weights_that_do_not_cover_the_architecture(tmp_path: Path, demo_hf_dir: Path) -> None:
    # transformers would silently fill the missing tensors with random values and generate noise.
    model = make_tiny_model(tmp_path / "tiny", "llama", demo_hf_dir)
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    assert_error(generate(model, "--device", "cpu"), "model.layers.1.mlp.up_proj.weight", "config.json")


def test_weights_with_wrong_shapes(tmp_path: Path, demo_hf_dir: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny", "llama", demo_hf_dir)
    # The weights of a wider model under the same config.
    make_tiny_model(tmp_path / "wide", "llama", demo_hf_dir, hidden_size=128)
    shutil.copy(tmp_path / "wide" / "model.safetensors", model / "model.safetensors")
    assert_error(generate(model, "--device", "cpu"), "shape", "config.json")


# 7: GGUF files


def test_gguf_with_bad_magic(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGML" + bytes(1024))
    assert_error(generate(model), "model.gguf", "not a GGUF file")


def test_truncated_gguf(tmp_path: Path, demo_gguf: Path) -> None:
    model = tmp_path / "half.gguf"
    half = demo_gguf.stat().st_size // 2
    # The header and tensor table lie in the first few MiB; the rest of the half is a sparse hole.
    with demo_gguf.open("rb") as src:
        model.write_bytes(src.read(min(half, 8 << 20)))
    os.truncate(model, half)
    assert_error(generate(model), "half.gguf", "truncated")


def test_gguf_of_unsupported_architecture(tmp_path: Path) -> None:
    model = tmp_path / "tiny-bert.gguf"
    writer = gguf.GGUFWriter(str(model), "bert")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # With llama-cpp-python the default runtime for a GGUF file on a CPU is llama.cpp's, which names the encoder.
    encoder = ("encoder", "Hugging Face directory") if llama_cpp_installed() else ()
    assert_error(generate(model), "tiny-bert.gguf", "'bert'", "architecture", *encoder)


@pytest.mark.parametrize(
    ("runtime", "missing"),
    [("torch", "up_proj"), pytest.param("llama.cpp", "blk.1.ffn_up.weight", marks=needs_llama_cpp)],
)
def test_gguf_missing_a_tensor(tmp_path: Path, runtime: str, missing: str) -> None:
    model = tmp_path / "incomplete.gguf"
    write_tiny_llama_gguf(model, skip="blk.1.ffn_up.weight")
    assert_error(generate(model, "--device", "cpu", "--runtime", runtime), "incomplete.gguf", missing)


def write_tiny_llama_gguf(path: Path, skip: str) -> None:
    """A 2-layer llama GGUF with a 5-token byte-level vocabulary, every tensor but `skip` present (zeros)."""
    hidden, ffn, layers, vocab = 8, 16, 2, 5
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")  # without it the tokenizer logs a warning: a second stderr line
    writer.add_token_list(["<|endoftext|>", "h", "i", "hi", "Ġ"])
    writer.add_token_types([3, 1, 1, 1, 1])
    writer.add_token_merges(["h i"])
    writer.add_eos_token_id(0)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        for name, shape in {
            "attn_norm": (hidden,),
            "attn_q": (hidden, hidden),
            "attn_k": (hidden, hidden),
            "attn_v": (hidden, hidden),
            "attn_output": (hidden, hidden),
            "ffn_norm": (hidden,),
            "ffn_gate": (ffn, hidden),
            "ffn_up": (ffn, hidden),
            "ffn_down": (hidden, ffn),
        }.items():
            shapes[f"blk.{i}.{name}.weight"] = shape
    for name, shape in shapes.items():
        if name != skip:
            writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_file_that_is_neither_directory_nor_gguf(tmp_path: Path) -> None:
    model = tmp_path / "weights.bin"
    model.write_bytes(b"\x00" * 64)
    assert_error(generate(model), "weights.bin", "neither")


# 8: architectures in config.json


def test_encoder_generates_no_text(tmp_path: Path) -> None:
    # An encoder (BERT) loads for embeddings only: `generate` names what it does instead.
    model = make_tiny_bert(tmp_path / "bert")
    assert_error(generate(model), "encoder", "embeddings")


def test_encoder_decoder_architecture_in_config(tmp_path: Path) -> None:
    # BART has a "causal LM" head in transformers (as a decoder part), but a BART checkpoint cannot generate alone.
    model = write_config(tmp_path / "bart", model_type="bart", d_model=32, encoder_layers=1, decoder_layers=1)
    assert_error(generate(model), "'bart'", "encoder-decoder")


def test_unknown_architecture_in_config(tmp_path: Path) -> None:
    model = write_config(tmp_path / "foo", model_type="foo-bar")
    assert_error(generate(model), "'foo-bar'", "architecture")


def test_config_that_is_not_json(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{model_type: llama")
    assert_error(generate(model), "config.json", "not valid JSON")


# 9: memory


def test_model_larger_than_memory_is_refused_before_loading(tmp_path: Path, demo_hf_dir: Path) -> None:
    # At least 64 GiB of float32 and 4x this machine's RAM, so even a bfloat16 load cannot fit.
    hidden = 16384
    total = max(64 << 30, 4 * psutil.virtual_memory().total)
    vocab = -(-total // (4 * hidden))
    model = write_config(
        tmp_path / "huge",
        model_type="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=0,
        num_attention_heads=128,
        num_key_value_heads=128,
        tie_word_embeddings=True,
    )
    copy_small_files(demo_hf_dir, model, TOKENIZER_FILES)
    # A valid header for one [vocab, hidden] float32 tensor, and a sparse file exactly as long as it declares.
    size = vocab * hidden * 4
    header = json.dumps(
        {"model.embed_tokens.weight": {"dtype": "F32", "shape": [vocab, hidden], "data_offsets": [0, size]}}
    )
    header += " " * (-len(header) % 8)
    shard = model / "model.safetensors"
    shard.write_bytes(struct.pack("<Q", len(header)) + header.encode())
    os.truncate(shard, 8 + len(header) + size)

    started = time.perf_counter()
    result = generate(model, "--device", "cpu")
    elapsed = time.perf_counter() - started
    # "GiB ... is available" comes only from the pre-check, not from an out-of-memory error during a load.
    assert_error(result, "not enough memory on cpu", "the weights of huge", "GiB is available")
    assert elapsed < 60, f"the memory check took {elapsed:.1f} s: it must refuse before loading anything"


# 10: devices (the unit tests are in test_devices.py)


@pytest.mark.parametrize(
    "flags",
    [
        ("--device", "cuda"),
        ("--device", "cuda:7"),
        ("--backend", "cuda", "--device", "1"),
        ("--cuda-device", "3"),
    ],
    ids=["cuda", "cuda:7", "backend-cuda-device-1", "cuda-device-3"],
)
def test_cuda_unavailable(demo_gguf: Path, flags: tuple[str, ...]) -> None:
    assert_error(generate(demo_gguf, *flags, env=NO_GPU), "CUDA", "not available")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has Apple MPS")
def test_mps_unavailable(demo_gguf: Path) -> None:
    assert_error(generate(demo_gguf, "--device", "mps"), "mps", "not available")


def test_unknown_device(demo_gguf: Path) -> None:
    assert_error(generate(demo_gguf, "--device", "tpu"), "'tpu'", "unknown device")


def test_conflicting_backend_and_cuda_device(demo_gguf: Path) -> None:
    assert_error(generate(demo_gguf, "--backend", "cpu", "--cuda-device", "0"), "--cuda-device", "--backend cpu")


def test_conflicting_device_and_cuda_device(demo_gguf: Path) -> None:
    assert_error(generate(demo_gguf, "--device", "cpu", "--cuda-device", "0"), "--cuda-device", "--device cpu")


# 11: hub ids, resolved from the local cache only


def test_hub_id_not_in_cache(tmp_path: Path) -> None:
    result = generate("someorg/somemodel", env={"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert_error(result, "someorg/somemodel", "local Hugging Face cache", str(tmp_path))


def test_hub_id_in_cache_loads(tmp_path: Path, demo_hf_dir: Path) -> None:
    # huggingface_hub's cache layout: hub/models--ORG--NAME/{refs/main, snapshots/<commit>/<files>}.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tinyorg--tiny-llama"
    make_tiny_model(repo / "snapshots" / commit, "llama", demo_hf_dir)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    result = generate(
        "tinyorg/tiny-llama", "--device", "cpu", "--temperature", "0", "--json", env={"HF_HOME": str(tmp_path)}
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["tokens_out"] == 2


# 12: flag values


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (("--temperature", "3"), "--temperature"),
        (("--max-tokens", "0"), "--max-tokens"),
        (("--top-p", "1.5"), "--top-p"),
        (("--seed", "-1"), "--seed"),
        (("--stop", "a", "b", "c", "d", "e"), "--stop"),
    ],
    ids=["temperature", "max-tokens", "top-p", "seed", "stop"],
)
def test_bad_flag_values(flags: tuple[str, ...], needle: str) -> None:
    # `--model` is a missing path: a flag error must be reported before the model is looked at.
    result = cli("generate", "--model", "/nonexistent/model", "--prompt", "hi", *flags)
    assert_error(result, needle)
