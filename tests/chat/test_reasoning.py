"""Reasoning models (chat/reasoning.py): the text splitter, format detection, and a grammar that applies only after
the reasoning (engine/structured/grammar.py's dormant matcher, engine/runners/rows.py's unmasked row), on a tiny
random-weight Qwen3 model (tests/tiny_qwen3.py) through the engine at temperature 1.0 and over HTTP (reasoning_content,
reasoning_tokens, streamed deltas), and on the demo model on both runtimes."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch
from conftest import RUNTIMES, engine_config
from serving import running
from test_structured_output import allowed, generate_together
from tiny_qwen3 import END, QWEN3_TEMPLATE, R1_TEMPLATE, START, build_tiny_qwen3
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rbee_worker.chat.reasoning import (
    ReasoningFormat,
    ReasoningSplitter,
    detect_reasoning,
    opens_reasoning,
    opens_reasoning_ids,
)
from rbee_worker.engine.engine import Engine
from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.request_types import Request, StopReason
from rbee_worker.engine.runners.rows import RowSampling
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.engine.structured.grammar import CompiledGrammar, Grammars, GrammarSpec, Matcher, host_bitmask
from rbee_worker.hardware.devices import Placement, resolve_placement
from rbee_worker.loading.loader import load_model

THINK = ReasoningFormat()  # the splitter reads the tags' text only
HOT = SamplingParams(temperature=1.0)
SEEDS = list(range(1, 11))
# An enum, an integer range and a boolean: every output the grammar allows ends within a few tokens.
THING = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 1, "maximum": 99},
        "round": {"type": "boolean"},
    },
    "required": ["color", "size", "round"],
}
ASK = [{"role": "user", "content": "Describe a ball as JSON: color, size, whether it is round."}]


# --- the splitter ----------------------------------------------------------------------------------------------------


def split(pieces: list[str], opened: bool) -> tuple[str, str, list[bool]]:
    """The whole reasoning and content of these pieces, and each piece's in_reasoning."""
    splitter = ReasoningSplitter(THINK, opened)
    reasoning, content, flags = "", "", []
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
        flags.append(splitter.in_reasoning)
    r, c = splitter.finish()
    return reasoning + r, content + c, flags


@pytest.mark.parametrize(
    ("text", "opened", "reasoning", "content"),
    [
        ("<think>\nWhy?\n</think>\n\nBecause.", False, "\nWhy?\n", "\n\nBecause."),
        ("\nWhy?\n</think>\n\nBecause.", True, "\nWhy?\n", "\n\nBecause."),
        # The first end tag ends the reasoning; the rest is content exactly as written, tags included.
        ("Hmm</think>A <think>b</think> c", True, "Hmm", "A <think>b</think> c"),
        ("<think>a<think>b</think>c", False, "a<think>b", "c"),
        # Opened without an end tag: all reasoning; neither tag: all content.
        ("still thinking </thin", True, "still thinking </thin", ""),
        ("Just an answer.", False, "", "Just an answer."),
        # Not opened: a start tag that is not the output's first text, or an end tag alone, is content.
        (" <think>x</think>y", False, "", " <think>x</think>y"),
        ("x</think>y", False, "", "x</think>y"),
        ("<thinking>", False, "", "<thinking>"),
        ("<thi", False, "", "<thi"),  # a start tag never completed
        ("<think>", False, "", ""),
        ("", True, "", ""),
    ],
)
def test_the_splitter_whole_and_piece_by_piece(text: str, opened: bool, reasoning: str, content: str) -> None:
    """The same split whether the text comes at once, a character at a time, or in pieces cut inside the tags."""
    assert split([text], opened)[:2] == (reasoning, content)
    assert split(list(text), opened)[:2] == (reasoning, content)
    for cut in range(len(text) + 1):
        assert split([text[:cut], text[cut:]], opened)[:2] == (reasoning, content), cut


def test_a_partial_tag_is_held_back_until_the_next_piece_decides_it() -> None:
    splitter = ReasoningSplitter(THINK, opened=False)
    assert splitter.feed("<th") == ("", "")
    assert splitter.feed("ink>Let me see.</") == ("Let me see.", "")
    assert splitter.in_reasoning
    assert splitter.feed("thin") == ("", "")
    assert splitter.feed("g") == ("</thing", "")  # not the end tag after all: reasoning, as it was written
    assert splitter.feed("</think>\n\nYes") == ("", "\n\nYes")
    assert splitter.feed("<") == ("", "<")  # in the content nothing is held
    assert splitter.finish() == ("", "")
    opened = ReasoningSplitter(THINK, opened=True)
    assert opened.feed("a</thi") == ("a", "")
    assert opened.finish() == ("</thi", "")


def test_in_reasoning_marks_the_pieces_of_the_reasoning_and_its_tags() -> None:
    pieces = ["<think>", "\n", "hm", "</think>", "\n\n", "{}"]
    assert split(pieces, opened=False)[2] == [True, True, True, True, False, False]
    assert split(["hm", "</think>", "ok"], opened=True)[2] == [True, True, False]
    assert split(["No", " tags"], opened=False)[2] == [False, False]
    # A piece that ends the reasoning and starts the content is part of the reasoning.
    assert split(["a</think>b", "c"], opened=True)[2] == [True, False]


S, E = 7, 8  # the tags' ids in the prompts below


@pytest.mark.parametrize(
    ("prompt", "ids", "opens"),
    [
        ("<|im_start|>assistant\n<think>\n", [1, 2, S, 3], True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", [1, 2, S, 3, E, 3], False),
        ("<|im_start|>assistant\n", [1, 2], False),
        ("<think>a</think>b<|im_start|>assistant\n<think>", [S, 4, E, 5, 1, 2, S], True),
    ],
)
def test_opens_reasoning_on_text_and_on_token_ids(prompt: str, ids: list[int], opens: bool) -> None:
    assert opens_reasoning(THINK, prompt) is opens
    assert opens_reasoning_ids(ReasoningFormat(start_id=S, end_id=E), ids) is opens
    assert not opens_reasoning_ids(ReasoningFormat(start_id=None, end_id=E), ids)  # no ids: the engine cannot tell


# --- detection -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), demo_tokenizer_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_qwen3)


@pytest.fixture(scope="module")
def think(tokenizer: PreTrainedTokenizerBase) -> ReasoningFormat:
    start_id, end_id = tokenizer.convert_tokens_to_ids([START, END])
    return ReasoningFormat(start_id=start_id, end_id=end_id)


def test_detected_from_the_template_where_the_tokenizer_has_the_end_tag(
    tokenizer: PreTrainedTokenizerBase, think: ReasoningFormat, demo_tokenizer_dir: Path
) -> None:
    assert think.start_id is not None and think.end_id is not None and think.start_id != think.end_id
    assert detect_reasoning(QWEN3_TEMPLATE, tokenizer) == think
    assert detect_reasoning(R1_TEMPLATE, tokenizer) == think
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert detect_reasoning(plain, tokenizer) is None
    assert detect_reasoning(None, tokenizer) is None
    # A template that writes the tags for a tokenizer that has no such token: not a model trained to reason.
    assert detect_reasoning(QWEN3_TEMPLATE, AutoTokenizer.from_pretrained(demo_tokenizer_dir)) is None


def test_the_reasoning_parser_flag_reaches_the_engine_config() -> None:
    from rbee_worker.cli.flags import build_parser
    from rbee_worker.cli.serve import engine_config

    placement = Placement(torch.device("cpu"), torch.float32)
    for flags, parser in (([], "auto"), (["--reasoning-parser", "none"], "none")):
        args = build_parser().parse_args(["serve", "--model", "demo", *flags])
        assert engine_config(args, placement).reasoning_parser == parser
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
    assert exited.value.code == 2
    with pytest.raises(ValueError, match="reasoning_parser"):
        EngineConfig(reasoning_parser="qwen3")


# --- the matcher and the sampler's rows ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grammars(tokenizer: PreTrainedTokenizerBase) -> Iterator[Grammars]:
    grammars = Grammars(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}), timeout_s=10.0)
    yield grammars
    grammars.close()


@pytest.fixture(scope="module")
def thing(grammars: Grammars) -> CompiledGrammar:
    return grammars.compile(GrammarSpec.json_schema(THING)).result(timeout=60)


def first_allowed(grammars: Grammars, grammar: CompiledGrammar, vocab: int) -> set[int]:
    """What the grammar alone allows first."""
    bitmask = host_bitmask(1, vocab)
    grammars.matcher(grammar).fill(bitmask, 0)
    return allowed(bitmask)


def fill(matcher: Matcher, vocab: int) -> set[int] | None:
    """The tokens the matcher allows next; None when it masks nothing (dormant)."""
    bitmask = host_bitmask(1, vocab)
    bitmask.zero_()  # a dormant matcher must not rely on what the row held
    return allowed(bitmask) if matcher.fill(bitmask, 0) else None


def test_the_first_token_may_open_the_reasoning_then_the_grammar_waits_for_its_end(
    grammars: Grammars, thing: CompiledGrammar, tokenizer: PreTrainedTokenizerBase, think: ReasoningFormat
) -> None:
    vocab = len(tokenizer)
    first = first_allowed(grammars, thing, vocab)
    prose = tokenizer.encode("Some thoughts: [1, 2] are not JSON objects.", add_special_tokens=False)
    matcher = grammars.matcher(thing, think, tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False))
    assert fill(matcher, vocab) == first | {think.start_id}
    assert matcher.accept(think.start_id)
    for token in prose:  # what the grammar refuses, and the start tag again, are reasoning now
        assert fill(matcher, vocab) is None and matcher.accept(token) and not matcher.terminated
    assert matcher.accept(think.start_id) and fill(matcher, vocab) is None
    assert matcher.accept(think.end_id)
    assert fill(matcher, vocab) == first  # the grammar from its start, the start tag no more
    assert not matcher.accept(think.start_id) and not matcher.accept(prose[0])
    for token in tokenizer.encode('{"color": "red", "size": 5, "round": true}', add_special_tokens=False):
        assert matcher.accept(token)
    assert fill(matcher, vocab) == {tokenizer.eos_token_id}


def test_a_first_token_of_the_grammar_leaves_no_reasoning(
    grammars: Grammars, thing: CompiledGrammar, tokenizer: PreTrainedTokenizerBase, think: ReasoningFormat
) -> None:
    vocab = len(tokenizer)
    closed = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    matcher = grammars.matcher(thing, think, closed)
    assert think.start_id in fill(matcher, vocab)  # a closed prompt, as one without tags: the model may reason
    assert matcher.accept(tokenizer.convert_tokens_to_ids("{"))
    assert think.start_id not in fill(matcher, vocab)
    assert not matcher.accept(think.start_id) and not matcher.accept(think.end_id)


def test_a_prompt_that_opens_the_reasoning_leaves_the_matcher_dormant_until_the_end_tag(
    grammars: Grammars, thing: CompiledGrammar, tokenizer: PreTrainedTokenizerBase, think: ReasoningFormat
) -> None:
    vocab = len(tokenizer)
    opened = tokenizer.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    matcher = grammars.matcher(thing, think, opened)
    for token in tokenizer.encode("[no]", add_special_tokens=False):
        assert fill(matcher, vocab) is None and matcher.accept(token)
    assert matcher.accept(think.end_id)
    assert fill(matcher, vocab) == first_allowed(grammars, thing, vocab)
    # A format without both token ids cannot see where the reasoning ends: the grammar applies from the start.
    no_ids = grammars.matcher(thing, ReasoningFormat(start_id=think.start_id), opened)
    assert fill(no_ids, vocab) == first_allowed(grammars, thing, vocab)


def test_a_dormant_row_is_unmasked(
    grammars: Grammars, thing: CompiledGrammar, tokenizer: PreTrainedTokenizerBase, think: ReasoningFormat
) -> None:
    """Once the start tag is drawn the row's mask goes, on the device and in the sampler's features: the row draws
    from every token, not from what the grammar allowed first; the masked row beside it keeps its own mask."""
    vocab = len(tokenizer)
    sampling = RowSampling(2, vocab, torch.device("cpu"))
    for row in (0, 1):
        sampling.assign(row, HOT, seed=row, prompt_ids=[1], logprobs=None)
    first = first_allowed(grammars, thing, vocab)
    plain, reasoning = grammars.matcher(thing), grammars.matcher(thing, think, [1])
    sampling.mask(0, plain)
    sampling.mask(1, reasoning)
    assert sampling.features([1]).masks and allowed(sampling.state.allowed, 1) == first | {think.start_id}
    reasoning.accept(think.start_id)
    sampling.mask(1, reasoning)
    assert sampling.features([0, 1]).masks and not sampling.features([1]).masks
    assert bool((sampling.state.allowed[1] == -1).all())
    assert allowed(sampling.state.allowed, 0) == first
    draws = set()
    for _ in range(20):
        packed = sampling.sample(torch.zeros(2, vocab), [0, 1], [True, True])
        assert sampling.sampled(packed[0], 0).tokens[0] in first
        draws.add(sampling.sampled(packed[1], 1).tokens[0])
    assert draws - first - {think.start_id}  # uniform logits over the whole vocabulary


# --- the tiny Qwen3 model, through the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_qwen3: Path) -> Iterator[Engine]:
    # No prefix cache: a request computed alone computes the same numbers each time (compared below).
    engine = Engine(
        lambda: load_model(str(tiny_qwen3), resolve_placement("cpu", "float32"), runtime="torch"),
        engine_config(prefix_caching=False),
    )
    yield engine
    engine.close()


def chat(engine: Engine, template: str = QWEN3_TEMPLATE, **variables: bool) -> tuple[int, ...]:
    text = engine.loaded.tokenizer.apply_chat_template(
        ASK, chat_template=template, add_generation_prompt=True, tokenize=False, **variables
    )
    return engine.model.tokenize(text, add_special_tokens=False)


def constrained(engine: Engine, prompt: tuple[int, ...]) -> list[str]:
    """Each seed's text, its grammar following its reasoning; every request ends on the grammar's EOS."""
    grammar = engine.model.grammars.compile(GrammarSpec.json_schema(THING)).result(timeout=60)
    requests = [
        Request(prompt, max_tokens=200, sampling=HOT, seed=seed, grammar=grammar, reasoning=engine.model.reasoning)
        for seed in SEEDS
    ]
    results = generate_together(engine, requests)
    for text, end in results:
        assert end.stop_reason is StopReason.EOS, text
    return [text for text, _ in results]


def refused_by_the_schema(text: str) -> bool:
    """Whether some of the text could not start an output of THING (the grammar would have refused it)."""
    return not '{"color": "'.startswith(text[:11])


def test_the_engine_detects_the_format_honouring_the_flag_and_the_template(
    engine: Engine, think: ReasoningFormat, tiny_qwen3: Path
) -> None:
    assert engine.model.reasoning == think
    cpu = resolve_placement("cpu", "float32")
    for config, template in ((engine_config(reasoning_parser="none"), None), (engine_config(), "{{ 'no tags' }}")):
        other = Engine(lambda t=template: load_model(str(tiny_qwen3), cpu, chat_template=t), config)
        try:
            assert other.model.reasoning is None
        finally:
            other.close()


def test_an_opened_prompt_reasons_freely_then_follows_the_schema(engine: Engine) -> None:
    texts = constrained(engine, chat(engine, R1_TEMPLATE))
    reasonings = []
    for text in texts:
        reasoning, end, answer = text.partition(END)
        assert end, text
        jsonschema.validate(json.loads(answer), THING)
        reasonings.append(reasoning)
    assert sum(refused_by_the_schema(r) for r in reasonings if r) >= len(SEEDS) // 2, reasonings
    assert len(set(texts)) > 1


def test_a_dormant_request_draws_what_an_unconstrained_one_draws(engine: Engine) -> None:
    """Until its end tag, a request whose prompt opens the reasoning draws exactly the tokens of the same request
    without a grammar: its row is not masked at all (each request runs alone, so that both compute the same)."""
    prompt = chat(engine, R1_TEMPLATE)
    grammar = engine.model.grammars.compile(GrammarSpec.json_schema(THING)).result(timeout=60)
    for seed in SEEDS[:3]:
        [(free, _)] = generate_together(engine, [Request(prompt, 200, HOT, seed)])
        [(text, _)] = generate_together(
            engine, [Request(prompt, 200, HOT, seed, grammar=grammar, reasoning=engine.model.reasoning)]
        )
        assert END in free and END in text
        assert text.partition(END)[0] == free.partition(END)[0], (text, free)


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_a_prompt_that_does_not_open_the_reasoning_is_constrained_from_its_first_token(
    engine: Engine, enable_thinking: bool
) -> None:
    """Qwen3's template without enable_thinking=False leaves the model to open its reasoning, and with it closes the
    reasoning in the prompt: either way the first token is the grammar's own or the start tag, which defers the
    grammar until the reasoning ends."""
    texts = constrained(engine, chat(engine, enable_thinking=enable_thinking))
    reasoned = [text for text in texts if text.startswith(START)]
    for text in texts:
        answer = text.partition(END)[2] if text.startswith(START) else text
        jsonschema.validate(json.loads(answer), THING)
    assert 0 < len(reasoned) < len(texts), texts  # both ways, over the seeds
    assert any(refused_by_the_schema(text.removeprefix(START).partition(END)[0]) for text in reasoned), reasoned


# --- the demo model, on both runtimes --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_both_runtimes_unmask_a_dormant_row(demo_gguf: Path, runtime: str) -> None:
    """The demo model has no reasoning tags; a format made of its own tokens stands in for one (the prompt's last
    `<|im_start|>` opens the reasoning, the first "." token ends it), so that both runtimes run the same dormant
    rows: free prose first, the schema after the full stop; and where the end tag never comes, the model's EOS ends
    the request in its reasoning."""
    engine = Engine(
        lambda: load_model(str(demo_gguf), resolve_placement("cpu", "auto"), runtime=runtime), engine_config()
    )
    try:
        tokenizer = engine.loaded.tokenizer
        start_id, full_stop = tokenizer.convert_tokens_to_ids(["<|im_start|>", "."])
        fmt = ReasoningFormat("<|im_start|>", ".", start_id, full_stop)
        grammar = engine.model.grammars.compile(GrammarSpec.json_schema(THING)).result(timeout=60)
        chat_settings = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1)
        bees = engine.model.tokenize_chat(
            [{"role": "user", "content": "Tell me about bees, then describe one as JSON."}]
        )
        never = ReasoningFormat("<|im_start|>", "", start_id, engine.model.vocab_size + 1)
        hello = engine.model.tokenize_chat([{"role": "user", "content": "Say hello."}])
        [(text, end), (unending, unended)] = generate_together(
            engine,
            [
                Request(bees, 200, chat_settings, 1, grammar=grammar, reasoning=fmt),
                Request(hello, 100, chat_settings, 1, grammar=grammar, reasoning=never),
            ],
        )
        prose, answer = text[: text.index('{"color": "')], text[text.index('{"color": "') :]
        assert end.stop_reason is StopReason.EOS and prose.endswith("."), text
        assert len(prose) > 10 and refused_by_the_schema(prose), text
        jsonschema.validate(json.loads(answer), THING)
        assert unended.stop_reason is StopReason.EOS and refused_by_the_schema(unending), unending
    finally:
        engine.close()


# --- the tiny model over HTTP ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def r1_client(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3: Path) -> Iterator[openai.OpenAI]:
    """A worker serving the tiny model with DeepSeek-R1's template (the prompt opens the reasoning)."""
    directory = tmp_path_factory.mktemp("r1-worker")
    template = directory / "r1.jinja"
    template.write_text(R1_TEMPLATE)
    flags = ("--model", str(tiny_qwen3), "--runtime", "torch", "--dtype", "float32", "--chat-template", str(template))
    with running(directory, *flags, fork=True) as worker:
        yield openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=120)


def reasoning_of(message: Any) -> str | None:
    """A message's or a delta's reasoning_content (an extension field: the openai client keeps it as an extra)."""
    return (message.model_extra or {}).get("reasoning_content")


@pytest.mark.slow
def test_reasoning_content_apart_over_http_streamed_as_not(r1_client: openai.OpenAI) -> None:
    """The reasoning is message.reasoning_content (no tags) and counted in usage; the answer after it follows the
    schema; streamed, the deltas concatenate to the same reasoning and content. The prompt is computed once first, so
    both compared requests find it cached alike."""
    model = r1_client.models.list().data[0].id
    schema = {"type": "json_schema", "json_schema": {"name": "thing", "schema": THING}}
    common = {"model": model, "messages": ASK, "temperature": 1.0, "max_tokens": 200, "response_format": schema}
    r1_client.chat.completions.create(**{**common, "max_tokens": 1})
    for seed in (1, 2, 3):
        reply = r1_client.chat.completions.create(**common, seed=seed)
        message, usage = reply.choices[0].message, reply.usage
        reasoning = reasoning_of(message)
        assert reply.choices[0].finish_reason == "stop" and reasoning is not None, reply
        assert START not in reasoning and END not in reasoning
        jsonschema.validate(json.loads(message.content), THING)
        reasoning_tokens = usage.completion_tokens_details.reasoning_tokens
        assert 0 < reasoning_tokens < usage.completion_tokens
        chunks = list(
            r1_client.chat.completions.create(**common, seed=seed, stream=True, stream_options={"include_usage": True})
        )
        deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
        assert "".join(reasoning_of(d) or "" for d in deltas) == reasoning
        assert "".join(d.content or "" for d in deltas) == message.content
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    plain = r1_client.chat.completions.create(model=model, messages=ASK, temperature=1.0, seed=1, max_tokens=40)
    assert reasoning_of(plain.choices[0].message)  # no schema: the reasoning is split off all the same


@pytest.mark.slow
def test_the_responses_api_gives_the_reasoning_as_its_own_item(r1_client: openai.OpenAI) -> None:
    """POST /v1/responses on the reasoning model: a `reasoning` item (its reasoning_text, no tags) before the message,
    whose text follows the schema, with reasoning_tokens in usage; the same seed gives the chat's reasoning and answer;
    streamed, the reasoning_text deltas make the same reasoning and the output_text deltas the same text."""
    model = r1_client.models.list().data[0].id
    text_format = {"format": {"type": "json_schema", "name": "thing", "schema": THING}}
    common = {"model": model, "temperature": 1.0, "max_output_tokens": 200, "text": text_format}
    extra = {"seed": 2}  # the worker's extension, as chat's
    response = r1_client.responses.create(input=ASK[-1]["content"], **common, extra_body=extra)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"], response.output
    reasoning = response.output[0].content[0].text
    assert reasoning and START not in reasoning and END not in reasoning
    jsonschema.validate(json.loads(response.output_text), THING)
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    chat = r1_client.chat.completions.create(
        model=model, messages=ASK[-1:], temperature=1.0, max_tokens=200, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": THING}},
    )  # fmt: skip
    assert (reasoning_of(chat.choices[0].message), chat.choices[0].message.content) == (reasoning, response.output_text)
    events = list(r1_client.responses.create(input=ASK[-1]["content"], **common, extra_body=extra, stream=True))
    deltas = {kind: "".join(e.delta for e in events if e.type == kind)
              for kind in ("response.reasoning_text.delta", "response.output_text.delta")}  # fmt: skip
    assert deltas == {"response.reasoning_text.delta": reasoning, "response.output_text.delta": response.output_text}
    assert events[-1].type == "response.completed"
