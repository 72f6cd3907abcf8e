"""build_tokenizer: a GGUF file's tokenizer metadata -> a transformers fast tokenizer that tokenizes like llama.cpp.

Expected ids marked "llama.cpp" were produced by llama.cpp itself (commit 0c1e570, the one vendored by
llama-cpp-python 0.3.36) through llama_tokenize(add_special=true, parse_special=true) on the same files.
"""

import logging
import time
from pathlib import Path
from typing import Any

import gguf
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rbee_worker.errors import ModelLoadError
from rbee_worker.loading.gguf.gguf_tokenizer import build_tokenizer


def read_metadata(path: Path) -> dict[str, Any]:
    reader = gguf.GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items()}


@pytest.fixture(scope="session")
def demo_metadata(demo_gguf: Path) -> dict[str, Any]:
    return read_metadata(demo_gguf)


@pytest.fixture(scope="session")
def demo(demo_metadata: dict[str, Any]) -> PreTrainedTokenizerFast:
    return build_tokenizer(demo_metadata)


def tokens_of(tokenizer: PreTrainedTokenizerFast, text: str) -> list[str]:
    return tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))


# --- the demo model: SmolLM2-135M-Instruct, byte-level BPE, pre "smollm" ---------------------------------------------


def test_demo_metadata_is_what_these_tests_assume(demo_metadata: dict[str, Any]) -> None:
    assert demo_metadata["tokenizer.ggml.model"] == "gpt2"
    assert demo_metadata["tokenizer.ggml.pre"] == "smollm"
    assert demo_metadata["tokenizer.ggml.add_bos_token"] is False


def test_digits_are_split_one_by_one(demo: PreTrainedTokenizerFast) -> None:
    assert tokens_of(demo, "12345") == ["1", "2", "3", "4", "5"]
    # The vocabulary has no token with two digits, so the split only shows in the ids through its side effect:
    # the digits are cut off first, which leaves both spaces at the end of "x  " and so joined (llama.cpp agrees).
    # The GPT-2 regex alone gives "x", " ", " 2024": ["x", "Ġ", "Ġ", "2", ...].
    assert tokens_of(demo, "x  2024") == ["x", "ĠĠ", "2", "0", "2", "4"]


def test_special_token_is_matched_whole(demo: PreTrainedTokenizerFast) -> None:
    ids = demo("<|im_start|>user")["input_ids"]
    assert ids[0] == 1
    assert demo.convert_ids_to_tokens(ids) == ["<|im_start|>", "user"]


def test_no_bos_is_added_when_the_file_says_so(demo: PreTrainedTokenizerFast) -> None:
    assert demo("Hello")["input_ids"] == demo("Hello", add_special_tokens=False)["input_ids"]
    assert demo.encode("Hello") == demo.convert_tokens_to_ids(["Hello"])


def test_special_token_names(demo: PreTrainedTokenizerFast) -> None:
    assert (demo.bos_token, demo.bos_token_id) == ("<|im_start|>", 1)
    assert (demo.eos_token, demo.eos_token_id) == ("<|im_end|>", 2)
    assert (demo.unk_token, demo.pad_token) == ("<|endoftext|>", "<|im_end|>")


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! It's a test.",
        "Crème brûlée, naïve façade, Ærøskøbing",
        "日本語のテキストと中文文本",
        "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦",
        "def f(x):\n    return x  # comment\n\n\n\tclass A:  \r\n pass   ",
        "  leading and trailing spaces  ",
        "spaces before punctuation : ; ! ? . ,",
    ],
)
def test_round_trip(demo: PreTrainedTokenizerFast, text: str) -> None:
    assert demo.decode(demo.encode(text)) == text


def test_skip_special_tokens_drops_control_tokens(demo: PreTrainedTokenizerFast) -> None:
    # <file_sep> is a control token that is not also the file's BOS/EOS/UNK/PAD token.
    ids = demo.encode("<|im_start|>assistant\nHi<file_sep>there<|im_end|>")
    assert demo.decode(ids) == "<|im_start|>assistant\nHi<file_sep>there<|im_end|>"
    assert demo.decode(ids, skip_special_tokens=True) == "assistant\nHithere"


def test_unknown_type_tokens_are_special_like_control_ones(demo_metadata: dict[str, Any]) -> None:
    # llama.cpp matches UNKNOWN-type tokens whole and hides them like control ones, even when not the file's UNK.
    types = list(demo_metadata["tokenizer.ggml.token_type"])
    assert demo_metadata["tokenizer.ggml.tokens"][16] == "<empty_output>"
    types[16] = gguf.TokenType.UNKNOWN
    tokenizer = build_tokenizer({**demo_metadata, "tokenizer.ggml.token_type": types})
    ids = tokenizer.encode("a<empty_output>b")
    assert ids[1] == 16
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"


def test_chat_template_is_the_files(demo: PreTrainedTokenizerFast) -> None:
    prompt = demo.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_known_tokenizations_of_the_vocabulary(demo: PreTrainedTokenizerFast, demo_metadata: dict[str, Any]) -> None:
    merges = demo_metadata["tokenizer.ggml.merges"]
    # Worked out by hand from the GPT-2 regex and the merges ("Ġ" is the byte-level space, "Ċ" the newline).
    # " a" is one regex piece and the second merge of all joins it.
    assert merges[1] == "Ġ a"
    assert tokens_of(demo, " a") == ["Ġa"]
    # Trailing spaces stay together ("\s+(?!\S)" at the end), and the fifth merge joins two of them.
    assert merges[4] == "Ġ Ġ"
    assert tokens_of(demo, "  ") == ["ĠĠ"]
    # Inside text, "\s+(?!\S)" leaves the last space to the next word: "a", " ", " b".
    assert "Ġ b" in merges
    assert tokens_of(demo, "a  b") == ["a", "Ġ", "Ġb"]
    # So do newlines: "\n" then "\n" then "b", while at the end the two newlines are one piece and one token.
    assert "Ċ Ċ" in merges
    assert tokens_of(demo, "a\n\nb") == ["a", "Ċ", "Ċ", "b"]
    assert tokens_of(demo, "ab\n\n") == ["ab", "ĊĊ"]
    # Whole words that are tokens, the last merge of each being "Ġhel lo", "hell o" and "Ġwor ld".
    assert {"Ġhel lo", "hell o", "Ġwor ld"} <= set(merges)
    assert tokens_of(demo, " hello") == ["Ġhello"]
    assert tokens_of(demo, "hello world") == ["hello", "Ġworld"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [  # llama.cpp
        ("I'm here, aren't you?", [57, 5248, 1535, 28, 4775, 982, 346, 47]),
        ("x = 1234  # ok\n\n", [104, 446, 216, 33, 34, 35, 36, 216, 907, 10907, 1116]),
        ("  indented\n\tline", [216, 641, 6574, 198, 197, 1311]),
        ("<|im_start|>user\nHi<|im_end|>\n", [1, 4093, 198, 26843, 2, 198]),
    ],
)
def test_demo_matches_llama_cpp(demo: PreTrainedTokenizerFast, text: str, expected: list[int]) -> None:
    assert demo(text)["input_ids"] == expected


_MIXED = "(hello) IT'S 12345 $5!!\n\n  x ῼ 你好"
# "(hello) IT'S 12345" comes out the same under all the pre-tokenizers below.
_MIXED_HEAD = [24, 28120, 25, 9627, 23, 67, 216, 33, 34, 35, 36, 37]


@pytest.mark.parametrize(
    ("pre", "rest"),
    [  # llama.cpp, on the demo vocabulary with only tokenizer.ggml.pre changed (None: removed)
        ("default", [216, 20, 37, 10095, 8866, 1792, 15822, 140, 137, 216, 18645, 250, 48392, 138]),
        (None, [216, 20, 37, 10095, 8866, 1792, 15822, 140, 137, 216, 18645, 250, 48392, 138]),
        ("gpt-2", [1885, 37, 10095, 8866, 1792, 15822, 140, 137, 216, 18645, 250, 48392, 138]),
        ("llama-bpe", [1885, 37, 10095, 1116, 216, 1792, 15822, 140, 137, 216, 18645, 250, 48392, 138]),
        ("qwen2", [1885, 37, 10095, 1116, 216, 1792, 15822, 140, 137, 216, 18645, 250, 48392, 138]),
        ("deepseek-llm", [1885, 37, 10095, 198, 198, 216, 1792, 216, 30365, 137, 216, 18645, 250, 48392, 138]),
    ],
)
def test_pre_tokenizers_match_llama_cpp(demo_metadata: dict[str, Any], pre: str | None, rest: list[int]) -> None:
    metadata = {key: value for key, value in demo_metadata.items() if key != "tokenizer.ggml.pre"}
    tokenizer = build_tokenizer(metadata if pre is None else {**metadata, "tokenizer.ggml.pre": pre})
    assert tokenizer(_MIXED)["input_ids"] == [*_MIXED_HEAD, *rest]


def test_llama3_groups_digits_by_three_and_qwen2_one_by_one(demo_metadata: dict[str, Any]) -> None:
    # The demo vocabulary has no multi-digit tokens, so only the split itself shows the difference.
    for pre, pieces in (("llama-bpe", ["123", "45"]), ("qwen2", ["1", "2", "3", "4", "5"])):
        backend = build_tokenizer({**demo_metadata, "tokenizer.ggml.pre": pre}).backend_tokenizer
        assert [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str("12345")] == pieces


@pytest.mark.parametrize(("pre", "expected"), [("llama-bpe", ["abc"]), ("dbrx", ["ab", "c"])])
def test_llama3_takes_a_whole_word_token_even_when_merges_cannot_reach_it(pre: str, expected: list[str]) -> None:
    # llama.cpp (same regex for both; only llama3's family ignores the merges for a word that is a token).
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": ["a", "b", "c", "ab", "abc"],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.add_bos_token": False,
    }
    assert tokens_of(build_tokenizer(metadata), "abc") == expected


def test_unknown_pre_tokenizer_falls_back_to_gpt2_with_a_warning(
    demo_metadata: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="rbee_worker.loading.gguf.gguf_tokenizer"):
        tokenizer = build_tokenizer({**demo_metadata, "tokenizer.ggml.pre": "no-such-pre"})
    assert "no-such-pre" in caplog.text
    # Without smollm's digit split first, the GPT-2 regex keeps the space and the digits in one piece.
    assert [piece for piece, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(" 2024")] == ["Ġ2024"]


def test_bos_and_eos_follow_the_file(demo_metadata: dict[str, Any]) -> None:
    tokenizer = build_tokenizer(
        {**demo_metadata, "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}
    )
    plain = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    assert tokenizer("Hello")["input_ids"] == [1, *plain, 2]
    assert tokenizer.encode("Hello") == [1, *plain, 2]


@pytest.fixture(scope="module")
def transformers_build(demo_gguf: Path) -> tuple[PreTrainedTokenizerFast, float]:
    """transformers' own tokenizer of the demo file, converted from the GGUF, and the CPU time its conversion took."""
    start = time.process_time()
    reference = AutoTokenizer.from_pretrained(str(demo_gguf.parent), gguf_file=demo_gguf.name)
    return reference, time.process_time() - start


def test_matches_transformers_gguf_tokenizer_on_text_without_digits(
    demo: PreTrainedTokenizerFast, transformers_build: tuple[PreTrainedTokenizerFast, float]
) -> None:
    reference, _ = transformers_build
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "Crème brûlée, naïve façade. 日本語 😀",
        "def f(x):\n    return x  # done\n\n",
        "<|im_start|>user\nWhat's up?<|im_end|>\n<|im_start|>assistant\n",
        "   many    spaces\t\ttabs\r\n",
    ]
    for text in texts:
        assert demo.encode(text) == reference.encode(text), text


def test_build_is_fast(
    demo_metadata: dict[str, Any], transformers_build: tuple[PreTrainedTokenizerFast, float]
) -> None:
    # Against transformers' conversion of the same file in the same process (a ratio, as the machine's speed and load
    # vary): a worker starts on this build, and transformers' conversion takes seconds. CPU time, not wall time.
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        build_tokenizer(demo_metadata)
        best = min(best, time.process_time() - start)
    _, reference_seconds = transformers_build
    assert best < reference_seconds / 5, (best, reference_seconds)


# --- a small synthetic sentencepiece ("llama") vocabulary -----------------------------------------------------------
# The tokenizations expected below were checked against llama.cpp on this very file (plus the few llama.* keys it
# needs to load a vocabulary).

# (piece, score): llama.cpp merges the adjacent pair whose joined piece scores highest. "bc" outscores "ab" although
# it comes later in the vocabulary, so "abc" must become "a" + "bc".
_PIECES = [
    ("▁", -1.0),
    *((letter, -2.0 - index) for index, letter in enumerate("abcdehlorw")),
    ("▁h", -20.0),
    ("▁w", -21.0),
    ("he", -22.0),
    ("ll", -23.0),
    ("or", -24.0),
    ("ld", -25.0),
    ("▁he", -26.0),
    ("▁hell", -27.0),
    ("▁hello", -28.0),
    ("▁wor", -29.0),
    ("▁world", -30.0),
    ("ab", -40.0),
    ("bc", -35.0),
]
_BOS, _EOS, _FIRST_BYTE = 1, 2, 3


def write_sentencepiece_gguf(path: Path, **flags: bool) -> Path:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), *(p for p, _ in _PIECES), "<tool>"]
    scores = [0.0] * (3 + 256) + [score for _, score in _PIECES] + [0.0]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(_PIECES) + [gguf.TokenType.USER_DEFINED]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(_BOS)
    writer.add_eos_token_id(_EOS)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(flags.get("add_bos", True))
    writer.add_add_space_prefix(flags.get("add_space_prefix", True))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def spm(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    path = write_sentencepiece_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")
    return build_tokenizer(read_metadata(path))


def test_sentencepiece_prepends_bos_and_a_space(spm: PreTrainedTokenizerFast) -> None:
    ids = spm("hello world")["input_ids"]
    assert ids[0] == _BOS
    assert spm.convert_ids_to_tokens(ids) == ["<s>", "▁hello", "▁world"]
    assert spm("hello world", add_special_tokens=False)["input_ids"] == ids[1:]


def test_sentencepiece_leading_space_is_kept(spm: PreTrainedTokenizerFast) -> None:
    # llama.cpp prefixes " hello" with another space: "▁▁hello".
    assert tokens_of(spm, " hello") == ["▁", "▁hello"]
    assert spm.decode(spm.encode(" hello"), skip_special_tokens=True) == " hello"


def test_sentencepiece_merges_follow_scores_not_ids(spm: PreTrainedTokenizerFast) -> None:
    assert tokens_of(spm, "abc") == ["▁", "a", "bc"]


def test_sentencepiece_byte_fallback(spm: PreTrainedTokenizerFast) -> None:
    ids = spm.encode("hello😀", add_special_tokens=False)
    assert spm.convert_ids_to_tokens(ids) == ["▁hello", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert ids[1:] == [_FIRST_BYTE + byte for byte in "😀".encode()]
    assert spm.decode(spm.encode("hello😀 world"), skip_special_tokens=True) == "hello😀 world"


def test_sentencepiece_special_and_user_defined_tokens(spm: PreTrainedTokenizerFast) -> None:
    # Text after a whole-matched token gets its own space prefix, as in llama.cpp.
    assert tokens_of(spm, "hello<tool>world") == ["▁hello", "<tool>", "▁world"]
    ids = spm.encode("hello<tool>world</s>")
    assert spm.decode(ids, skip_special_tokens=True) == "hello<tool> world"
    # The unknown token is matched whole too, and is special.
    assert tokens_of(spm, "a<unk>b") == ["▁", "a", "<unk>", "▁", "b"]
    assert spm.decode(spm.encode("a<unk>b"), skip_special_tokens=True) == "a b"


def test_sentencepiece_without_space_prefix(tmp_path: Path) -> None:
    path = write_sentencepiece_gguf(tmp_path / "spm.gguf", add_space_prefix=False, add_bos=False)
    tokenizer = build_tokenizer(read_metadata(path))
    assert tokens_of(tokenizer, "hello world") == ["he", "ll", "o", "▁world"]
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"


# --- files we cannot use --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tokenizer.ggml.model": "rwkv"}, "unsupported tokenizer.ggml.model 'rwkv'"),
        ({"tokenizer.ggml.model": None}, "unsupported tokenizer.ggml.model None"),
        ({"tokenizer.ggml.tokens": None}, "no tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.merges": None}, "no tokenizer.ggml.merges"),
        ({"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": None}, "BOS"),
    ],
)
def test_unusable_metadata_raises_model_load_error(
    demo_metadata: dict[str, Any], changes: dict[str, Any], message: str
) -> None:
    metadata = {**demo_metadata, **changes}
    with pytest.raises(ModelLoadError, match="Hugging Face directory") as error:
        build_tokenizer({key: value for key, value in metadata.items() if value is not None})
    assert message in str(error.value)


def test_sentencepiece_without_scores_raises(tmp_path: Path) -> None:
    metadata = read_metadata(write_sentencepiece_gguf(tmp_path / "spm.gguf"))
    del metadata["tokenizer.ggml.scores"]
    with pytest.raises(ModelLoadError, match="score"):
        build_tokenizer(metadata)
