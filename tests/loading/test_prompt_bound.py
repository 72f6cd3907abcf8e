"""The most text one token stands for (loading/prompt_bound.py): never fewer tokens than the bound says, and no bound
for tokenizers that can drop text or make one token of any length."""

import random

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rbee_worker.loading.gguf.gguf_format import read_gguf
from rbee_worker.loading.gguf.gguf_tokenizer import build_tokenizer
from rbee_worker.loading.prompt_bound import OTHER_FIELDS_BYTES, PromptBound, prompt_bound, request_bytes_limit


def texts() -> list[str]:
    rng = random.Random(5)
    return [
        "#" * 5000,
        "\n" + " " * 4000,
        "héllo wörld, ünïcode " * 100,
        "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(2000)),
        "".join(chr(rng.choice([0x1F41D, 0x65, 0x301, 0x20])) for _ in range(2000)),  # astral, combining marks
        "<|im_start|>" * 300,
    ]


def wrap(backend: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def word_level(vocab: dict[str, int]) -> Tokenizer:
    return Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))


def test_the_demo_tokenizer_never_makes_fewer_tokens_than_its_bound(demo_gguf) -> None:
    tokenizer = build_tokenizer(read_gguf(demo_gguf).metadata)
    bound = prompt_bound(tokenizer)
    assert bound is not None and bound.unit == "bytes"
    assert bound.per_token == max(len(entry) for entry in tokenizer.get_vocab())  # a byte-level entry: one byte a char
    for text in texts():
        count = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert bound.least_tokens(text) <= count, text[:40]
    assert bound.least_tokens("#" * 5000) * 4 > len(tokenizer("#" * 5000)["input_ids"])  # not vacuous


def test_a_sentencepiece_style_vocabulary_counts_characters_and_normal_forms_widen_it() -> None:
    vocab = {"▁": 0, "a": 1, "▁aa": 2, "<0x41>": 3, "é": 4}
    backend = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    assert prompt_bound(wrap(backend)) == PromptBound(6, "characters")  # "<0x41>" is the longest entry
    backend.normalizer = normalizers.NFC()
    composed = wrap(backend)
    assert prompt_bound(composed) == PromptBound(24, "characters")
    text = "e\u0301" * 100  # composes to 100 characters
    assert prompt_bound(composed).least_tokens(text) <= len(composed(text)["input_ids"])


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Whitespace()), id="drops whitespace"),
        pytest.param(lambda t: setattr(t, "normalizer", normalizers.BertNormalizer()), id="drops control characters"),
        pytest.param(lambda t: setattr(t, "normalizer", normalizers.Strip()), id="strips"),
    ],
)
def test_a_tokenizer_that_can_drop_text_has_no_bound(make) -> None:
    backend = Tokenizer(models.BPE({"a": 0, " ": 1}, []))
    assert prompt_bound(wrap(backend)) == PromptBound(1, "characters")
    make(backend)
    assert prompt_bound(wrap(backend)) is None


def test_unknown_words_and_fused_unknowns_have_no_bound() -> None:
    assert prompt_bound(wrap(word_level({"[UNK]": 0, "a": 1}))) is None
    fused = Tokenizer(models.BPE({"[UNK]": 0, "a": 1}, [], unk_token="[UNK]", fuse_unk=True))
    assert prompt_bound(wrap(fused)) is None
    assert prompt_bound(wrap(Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")))) is None


def test_the_request_limit_is_the_longest_honest_body() -> None:
    assert request_bytes_limit(PromptBound(81, "bytes"), 8192) == 81 * 8192 * 6 + OTHER_FIELDS_BYTES
    assert request_bytes_limit(PromptBound(10, "characters"), 100) == 10 * 100 * 12 + OTHER_FIELDS_BYTES
    assert request_bytes_limit(None, 100) > 60 * 2**20
