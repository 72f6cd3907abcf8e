"""A reasoning model's thinking kept apart from its answer (Qwen3, DeepSeek-R1: `<think>...</think>` before the
answer), as vLLM's deepseek_r1 and qwen3 reasoning parsers split it.

- `detect_reasoning` finds a model's format from its chat template and tokenizer (vLLM asks for it by name with
  `--reasoning-parser`; here `--reasoning-parser auto` detects it and `none` turns it off).
- `opens_reasoning` says whether a prompt leaves the model inside an open `<think>` (DeepSeek-R1's template always
  does, Qwen3's does with `enable_thinking`), so that its output starts as reasoning.
- `ReasoningSplitter` splits a request's output text, as it streams, into reasoning and content.

The engine reads the format's token ids to apply a request's grammar only after its reasoning
(engine/structured/grammar.py); this module works on text alone.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rbee_worker.chat.pieces import held_suffix

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ReasoningFormat:
    """The tags around a model's reasoning, and each tag's token id where the tag is one token of the tokenizer (None
    otherwise: the engine then cannot tell from the tokens where the reasoning ends)."""

    start: str = "<think>"
    end: str = "</think>"
    start_id: int | None = None
    end_id: int | None = None


def detect_reasoning(chat_template: str | None, tokenizer: "PreTrainedTokenizerBase") -> ReasoningFormat | None:
    """The `<think>` format when the chat template writes `<think>` or `</think>` (a reasoning model's template) and
    `</think>` is one token of the tokenizer (a model trained to write it); None otherwise."""
    fmt = ReasoningFormat()
    if not chat_template or (fmt.start not in chat_template and fmt.end not in chat_template):
        return None
    vocab = tokenizer.get_vocab()
    end_id = vocab.get(fmt.end)
    if end_id is None:
        return None
    return ReasoningFormat(start_id=vocab.get(fmt.start), end_id=end_id)


def opens_reasoning(fmt: ReasoningFormat, prompt_text: str) -> bool:
    """Whether the prompt ends inside an open reasoning: its last start tag comes after its last end tag."""
    return prompt_text.rfind(fmt.start) > prompt_text.rfind(fmt.end)


def opens_reasoning_ids(fmt: ReasoningFormat, prompt_ids: Sequence[int]) -> bool:
    """`opens_reasoning` on token ids: the prompt's last start_id comes after its last end_id (False when either tag
    has no token id)."""
    if fmt.start_id is None or fmt.end_id is None:
        return False
    for token in reversed(prompt_ids):
        if token in (fmt.start_id, fmt.end_id):
            return token == fmt.start_id
    return False


class ReasoningSplitter:
    """Splits one output's text, piece by piece, into its reasoning and its content.

    The output is reasoning from its start when `opened` (the prompt ends inside an open start tag, see
    `opens_reasoning`), or when its first text is the start tag; the first end tag ends the reasoning and everything
    after it is content, exactly as written. Neither tag goes to either part. An output that does not start in
    reasoning is all content; one that never ends it is all reasoning. Text that may be the beginning of a tag is held
    back until the next piece decides it (`finish` releases it).
    """

    _START, _REASONING, _CONTENT = "start", "reasoning", "content"

    def __init__(self, fmt: ReasoningFormat, opened: bool) -> None:
        self._fmt = fmt
        # _START: no text decided yet, and it may be the start tag.
        self._state = self._REASONING if opened else self._START
        self._held = ""
        self.in_reasoning = False  # whether the latest piece fed is (part of) the reasoning, its tags included

    def feed(self, text: str) -> tuple[str, str]:
        """The next piece of the output: the (reasoning, content) text that it decides."""
        began = self._state
        reasoning, content = [], []
        self._held += text
        while self._held:
            if self._state == self._START:
                if self._held.startswith(self._fmt.start):
                    self._held = self._held[len(self._fmt.start) :]
                    self._state = self._REASONING
                elif self._fmt.start.startswith(self._held):
                    break  # still maybe the start tag
                else:
                    self._state = self._CONTENT
            elif self._state == self._REASONING:
                before, found, after = self._held.partition(self._fmt.end)
                if found:
                    reasoning.append(before)
                    self._held = after
                    self._state = self._CONTENT
                else:
                    keep = held_suffix(self._held, self._fmt.end)
                    reasoning.append(self._held[: len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep :]
                    break
            else:
                content.append(self._held)
                self._held = ""
        self.in_reasoning = self._REASONING in (began, self._state)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The output has ended: the (reasoning, content) text still held back, as what it is now."""
        held, self._held = self._held, ""
        return (held, "") if self._state == self._REASONING else ("", held)
