"""What callers ask of the loaded model, from any thread and without the engine thread: its tokenizer and chat
template, the text of each token, its limits (vocabulary and context), its reasoning format, the grammars compiled for
it, and whether a request can run on it."""

import threading
from typing import Any

from rbee_worker.chat.reasoning import ReasoningFormat, detect_reasoning
from rbee_worker.engine.detokenizer import token_texts
from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.request_checks import check_request
from rbee_worker.engine.request_types import Request
from rbee_worker.engine.structured.grammar import Grammars
from rbee_worker.loading.loaded import LoadedModel


class ServedModel:
    """The loaded model as its runner serves it: `context_length` is what its KV block pool holds (rows.kv_pool),
    `logits_width` its logits' width (which a grammar's masks cover)."""

    def __init__(self, loaded: LoadedModel, context_length: int, logits_width: int, config: EngineConfig) -> None:
        self.loaded, self.context_length, self.logits_width = loaded, context_length, logits_width
        self._grammar_timeout_s = config.grammar_compile_timeout_s
        # The whole vocabulary's texts, decoded once: logprobs ask for six tokens' texts per generated token (the
        # chosen one and the top five), a tokenizer call each otherwise.
        self._token_texts = token_texts(loaded.tokenizer)
        # Counted once: len() of a fast tokenizer asks the Rust tokenizer to count its vocabulary at every call, a
        # cost that some tokenizers builds make a large part of a request's host time.
        self.vocab_size = len(self._token_texts)
        self.reasoning: ReasoningFormat | None = None
        if config.reasoning_parser == "auto":
            template = loaded.tokenizer.chat_template  # a dict where a tokenizer names several templates: none found
            self.reasoning = detect_reasoning(template if isinstance(template, str) else None, loaded.tokenizer)
        self._grammars: Grammars | None = None  # made at the first use (`grammars`)
        self._grammars_lock = threading.Lock()

    def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        return self.loaded.tokenize(text, add_special_tokens)

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self.loaded.chat_prompt(messages, add_generation_prompt)

    def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[int, ...]:
        return self.loaded.tokenize_chat(messages, add_generation_prompt, tools, template_kwargs)

    def detokenize(self, token_ids: tuple[int, ...]) -> str:
        return self.loaded.tokenizer.decode(token_ids)

    def token_text(self, token_id: int) -> str:
        """One token's own text (a partial UTF-8 character decodes to U+FFFD); an id beyond the vocabulary decoded
        once, when first asked for."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.loaded.tokenizer.decode([token_id])
        return text

    def validate(self, request: Request) -> None:
        """Raise RequestError for a request that cannot run on this model (engine/request_checks.py)."""
        check_request(request, self.loaded, self.context_length, self.vocab_size)

    @property
    def grammars(self) -> Grammars:
        """Compiles requests' grammars for this model off the engine thread, once per spec
        (engine/structured/grammar.py)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(
                    self.loaded.tokenizer, self.logits_width, self.loaded.info.eos_token_ids, self._grammar_timeout_s
                )
            return self._grammars

    def close(self) -> None:
        """Stops the grammars' compiling processes, if any started."""
        with self._grammars_lock:
            if self._grammars is not None:
                self._grammars.close()
