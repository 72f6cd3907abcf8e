"""How much text one token can stand for: the bound that lets a request whose prompt cannot fit the context be refused
from its length alone, before it is tokenized (tokenizing megabytes takes seconds), and that sizes the largest request
body an honest request can have.

A tokenizer whose every step keeps or grows the text (normalizers, pre-tokenizers) and whose model turns each token
into at most L characters of it (its longest vocabulary entry or added token) makes at least len(text) / L tokens of
any text: a byte-level vocabulary counts in UTF-8 bytes (each entry's character is one byte), any other in characters.
Unicode normal forms can shrink a text (a base letter and up to three marks compose into one character), so they
divide the bound by COMPOSED_MOST. A tokenizer with a step that can drop text (BERT's clean-up, whitespace splitting,
a strip) or make one token of text of any length (an unknown token fused over a run of unknown characters, WordPiece's
unknown word, an added token that takes in the whitespace beside it) has no bound: its prompts are always tokenized.
"""

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

COMPOSED_MOST = 4  # code points (or UTF-8 bytes) that canonical composition turns into one character, at most
NORMAL_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
KEEPING_NORMALIZERS = frozenset({"Prepend", "Lowercase", "ByteLevel"}) | NORMAL_FORMS
KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"})
# JSON's longest escape of a unit: a byte as \u00XX; a character outside the BMP as a surrogate pair \uXXXX\uXXXX.
JSON_BYTES_PER_UNIT = {"bytes": 6, "characters": 12}
OTHER_FIELDS_BYTES = 1 << 20
UNBOUNDED_REQUEST_BYTES = 64 << 20


@dataclass(frozen=True)
class PromptBound:
    """At most `per_token` units of text (UTF-8 bytes or characters) make one token."""

    per_token: int
    unit: Literal["bytes", "characters"]

    def size(self, text: str) -> int:
        """The text's length in this bound's unit."""
        return len(text.encode("utf-8", "surrogatepass")) if self.unit == "bytes" else len(text)

    def least_tokens(self, text: str) -> int:
        """The fewest tokens the tokenizer can make of `text`."""
        return math.ceil(self.size(text) / self.per_token)


def prompt_bound(tokenizer: PreTrainedTokenizerBase) -> PromptBound | None:
    """The tokenizer's bound, or None when it has none (module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_text(spec.get("pre_tokenizer")) or not _bounded_model(spec["model"]):
        return None
    steps = _steps(spec.get("normalizer"), "normalizers") + _steps(spec.get("pre_tokenizer"), "pretokenizers")
    byte_level = any(step["type"] == "ByteLevel" for step in steps)
    unit: Literal["bytes", "characters"] = "bytes" if byte_level else "characters"
    added_tokens = tokenizer.added_tokens_decoder.values()
    if any(added.lstrip or added.rstrip for added in added_tokens):
        return None
    longest = max((len(entry) for entry in tokenizer.get_vocab()), default=1)
    for added in added_tokens:
        longest = max(longest, len(added.content.encode()) if byte_level else len(added.content))
    return PromptBound(max(longest, 1) * shrink, unit)


def _steps(spec: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """A normalizer's or pre-tokenizer's steps: a Sequence's members, else itself (none for None)."""
    if spec is None:
        return []
    if spec["type"] == "Sequence":
        return [step for member in spec[key] for step in _steps(member, key)]
    return [spec]


def _normalizer_shrink(spec: dict[str, Any] | None) -> int | None:
    """By how much the normalizer can shorten a text at most (1: never), or None when it can drop any amount."""
    shrink = 1
    for step in _steps(spec, "normalizers"):
        kind = step["type"]
        if kind in NORMAL_FORMS:
            shrink = max(shrink, COMPOSED_MOST)
        elif kind == "Replace" and "String" in step["pattern"] and step["content"]:
            shrink *= max(1, math.ceil(len(step["pattern"]["String"]) / len(step["content"])))
        elif kind not in KEEPING_NORMALIZERS:
            return None
    return shrink


def _keeps_text(spec: dict[str, Any] | None) -> bool:
    """Whether every pre-tokenizer step keeps all of the text (splits it, maps it), dropping none."""
    return all(
        step["type"] in KEEPING_PRE_TOKENIZERS and step.get("behavior") != "Removed"
        for step in _steps(spec, "pretokenizers")
    )


def _bounded_model(model: dict[str, Any]) -> bool:
    """Whether each token the model makes covers at most one vocabulary entry's text: BPE, and Unigram with byte
    fallback, unless runs of unknown characters fuse into one unknown token."""
    if model["type"] == "BPE":
        return model.get("unk_token") is None or bool(model.get("byte_fallback")) or not model.get("fuse_unk")
    return model["type"] == "Unigram" and bool(model.get("byte_fallback"))


def request_bytes_limit(bound: PromptBound | None, context: int) -> int:
    """The default request body limit (--max-request-bytes): the largest body of a request whose prompt fits `context`
    tokens: the prompt at the bound's most text a token, each unit written as JSON's longest escape of it, and
    OTHER_FIELDS_BYTES for the rest (sampling fields, a response_format schema: tool definitions are prompt text);
    UNBOUNDED_REQUEST_BYTES for a tokenizer without a bound."""
    if bound is None:
        return UNBOUNDED_REQUEST_BYTES
    return bound.per_token * context * JSON_BYTES_PER_UNIT[bound.unit] + OTHER_FIELDS_BYTES
