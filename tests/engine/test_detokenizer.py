"""Incremental detokenization: whole UTF-8 characters only, exact concatenation, stop strings held back and cut."""

from pathlib import Path

import pytest
from conftest import engine_config

from rbee_worker.engine.detokenizer import Detokenizer
from rbee_worker.engine.engine import Engine
from rbee_worker.engine.request_types import End, Request, Token
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.gguf.gguf_format import read_gguf
from rbee_worker.loading.gguf.gguf_tokenizer import build_tokenizer
from rbee_worker.loading.loader import load_model

# (text, whether some of its characters are split across tokens in the demo vocabulary)
MULTIBYTE_TEXTS = [
    ("naïve café résumé", False),
    ("日本の首都は東京です。", True),
    ("emoji 😀👍🏽🇫🇷 done", True),
    ("mixed: Ωmega ✓ 中文 🐝!", True),
]


@pytest.fixture(scope="module")
def tokenizer(demo_gguf: Path):
    return build_tokenizer(read_gguf(demo_gguf).metadata)


def stream(tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], Detokenizer]:
    detokenizer = Detokenizer(tokenizer.backend_tokenizer, stop)
    pieces = []
    for token_id in ids:
        pieces.append(detokenizer.add_token(token_id))
        if detokenizer.stop_matched:
            return pieces, detokenizer
    pieces.append(detokenizer.finish())
    return pieces, detokenizer


@pytest.mark.parametrize("text,split", MULTIBYTE_TEXTS)
def test_pieces_are_whole_characters_and_concatenate_to_decode(tokenizer, text: str, split: bool) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids) == split
    pieces, _ = stream(tokenizer, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text


def test_stop_string_spanning_tokens_is_held_back_then_cut(tokenizer) -> None:
    ids = tokenizer("The answer is forty-two, of course.", add_special_tokens=False)["input_ids"]
    pieces, detokenizer = stream(tokenizer, ids, stop=("two, of",))
    assert detokenizer.stop_matched == "two, of"
    assert "".join(pieces) == "The answer is forty-"
    assert all("two" not in p for p in pieces)


def test_partial_match_that_fails_is_released(tokenizer) -> None:
    ids = tokenizer("an apple and an apricot", add_special_tokens=False)["input_ids"]
    pieces, detokenizer = stream(tokenizer, ids, stop=("apricots",))
    assert detokenizer.stop_matched is None
    assert "".join(pieces) == "an apple and an apricot"
    assert pieces[-1].endswith("apricot")  # held back until the end, since "apricot" could still become "apricots"


def test_multibyte_stop_string(tokenizer) -> None:
    ids = tokenizer("weather: ☀️ then 🌧 rain", add_special_tokens=False)["input_ids"]
    pieces, detokenizer = stream(tokenizer, ids, stop=("🌧",))
    assert detokenizer.stop_matched == "🌧" and "".join(pieces) == "weather: ☀️ then "


def test_special_tokens_are_skipped(tokenizer) -> None:
    ids = tokenizer("<|im_start|>assistant\nHi<|im_end|>", add_special_tokens=False)["input_ids"]
    pieces, _ = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == "assistant\nHi"


@pytest.fixture(scope="module")
def engine(demo_gguf: Path):
    engine = Engine(lambda: load_model(str(demo_gguf), resolve_placement("cpu", "float32")), engine_config())
    yield engine
    engine.close()


@pytest.mark.parametrize(
    "chat,prompt",
    [
        (False, "Emoji: 😀😃😄😁 Emoji: 😀😃"),
        (False, "日本の首都は東京です。日本の首都は"),
        (True, "Write the word 'hello' in Japanese."),
        (False, "Café, naïve, résumé, café, naïve,"),
    ],
)
def test_real_model_multibyte_output_streams_cleanly(engine: Engine, chat: bool, prompt: str) -> None:
    prompt_ids = (
        engine.model.tokenize_chat([{"role": "user", "content": prompt}]) if chat else engine.model.tokenize(prompt)
    )
    events = list(engine.stream(Request(prompt_ids, max_tokens=40, sampling=SamplingParams(temperature=0.0))))
    pieces = [e for e in events if isinstance(e, Token)]
    ids = [i for p in pieces for i in p.token_ids]
    text = "".join(p.text for p in pieces)
    assert isinstance(events[-1], End)
    assert not text.isascii()
    assert all("\ufffd" not in p.text for p in pieces)
    # A character cut off by max_tokens is dropped rather than sent as U+FFFD.
    assert text == engine.loaded.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
