"""Incremental detokenization with stop strings.

Text is produced by `tokenizers.decoders.DecodeStream`, which emits a piece only once it decodes to whole UTF-8
characters and handles the leading-space rules of SentencePiece and byte-level BPE, so the pieces concatenate to
`tokenizer.decode(ids, skip_special_tokens=True)`, except that a character left incomplete when generation ends
(max_tokens reached in the middle of a multi-byte character) is dropped instead of becoming U+FFFD. On top of it,
text that could still be the start of a stop string is held back (at most the longest stop string minus one
character), and a matched stop string and everything after it are never released.
"""

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast


def token_texts(tokenizer: PreTrainedTokenizerFast) -> dict[int, str]:
    """Every token's own text, as `tokenizer.decode([id])` gives it (a partial UTF-8 character decodes to U+FFFD),
    decoded in one batch by the Rust tokenizer."""
    ids = [[i] for i in range(len(tokenizer))]
    texts = tokenizer.backend_tokenizer.decode_batch(ids, skip_special_tokens=False)
    if tokenizer.clean_up_tokenization_spaces:
        texts = [tokenizer.clean_up_tokenization(text) for text in texts]
    return dict(enumerate(texts))


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._text = ""  # everything decoded so far
        self._released = 0  # how much of _text has been returned
        self.stop_matched: str | None = None

    def add_token(self, token_id: int) -> str:
        """Feed one generated id; return the text that is now safe to release (maybe empty).

        After a stop string matches, `stop_matched` is set and the returned text ends right before it.
        """
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return ""
        search_from = max(0, len(self._text) - self._hold)
        self._text += piece
        if self._stop and (match := self._find_stop(search_from)) is not None:
            position, self.stop_matched = match
            return self._release(position)
        return self._release(len(self._text) - self._hold)

    def finish(self) -> str:
        """The held-back rest, once generation ended without a stop string."""
        return "" if self.stop_matched else self._release(len(self._text))

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        """Earliest stop string occurrence that ends in the newly added text."""
        found = [(i, s) for s in self._stop if (i := self._text.find(s, start)) >= 0]
        return min(found) if found else None

    def _release(self, upto: int) -> str:
        if upto <= self._released:
            return ""
        text = self._text[self._released : upto]
        self._released = upto
        return text
