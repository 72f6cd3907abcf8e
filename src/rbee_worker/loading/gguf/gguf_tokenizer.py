"""A Hugging Face fast tokenizer built from a GGUF file's metadata, tokenizing as llama.cpp does for that file.

A GGUF has no `tokenizer.json`: llama.cpp keeps the vocabulary, merges, scores and token types as metadata and
tokenizes with its own code (`src/llama-vocab.cpp`). We rebuild that behaviour from `tokenizers` parts:

- "gpt2" (byte-level BPE): the file's merges, split first by the regexes llama.cpp picks for `tokenizer.ggml.pre`.
- "llama" (sentencepiece): llama.cpp merges the best-scoring adjacent pair first, so a BPE whose merge ranks
  follow the merged piece's score does the same; unknown characters fall back to `<0xNN>` byte tokens.

Control, unknown and user-defined tokens are matched whole in the raw text before anything else, as llama.cpp's
`tokenizer_st_partition` does with `parse_special=true` (what llama-server uses for prompts).

Decoding follows Hugging Face's conventions instead (e.g. a sentencepiece text decodes without its prefix space even
after a BOS, where llama_detokenize keeps it), so that decode(encode(text)) == text.
"""

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from rbee_worker.errors import ModelLoadError

logger = logging.getLogger(__name__)

_SPACE = "\u2581"  # sentencepiece's visible space, "▁"

# llama.cpp's regexes (llama-vocab.cpp, llm_tokenizer_bpe), applied one after another: each splits every piece
# left by the previous one, keeping what it matched and what lies between as separate pieces.
# llama.cpp writes this one without the final "|\s+", but the hand-written matcher it runs for it has that branch.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# Escaped: an editor's Unicode normalization would silently change some of these characters (e.g. U+2126 OHM SIGN).
_DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376"
    "\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-"
    "\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d"
    "\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
)


@dataclass(frozen=True)
class _PreTokenizer:
    """How llama.cpp pre-tokenizes one family of `tokenizer.ggml.pre` values."""

    regexes: tuple[str, ...]
    # llama.cpp takes a pre-split piece that is itself a token as is, without running the merges on it.
    ignore_merges: bool = False
    # What llama.cpp does when the file has no `tokenizer.ggml.add_bos_token`.
    add_bos: bool = False


_DEFAULT = _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_GPT2_FAMILY = _PreTokenizer((_GPT2,))
_DIGITS_THEN_GPT2 = _PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_FAMILY = _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_LLAMA3_REGEX_ONLY = _PreTokenizer((_LLAMA3,))
_QWEN2_FAMILY = _PreTokenizer((_QWEN2,))

# `tokenizer.ggml.pre` -> pre-tokenizer, with the names llama.cpp groups under each of its pre types.
_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(
        ("gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum", "exaone4", "mpt", "olmo", "jais", "trillion"),
        _GPT2_FAMILY,
    ),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
        _DIGITS_THEN_GPT2,
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        _LLAMA3_FAMILY,
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), _LLAMA3_REGEX_ONLY),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
        _QWEN2_FAMILY,
    ),
    "deepseek-llm": _PreTokenizer(_DEEPSEEK_LLM),
}

_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
# llama.cpp's ids for a sentencepiece vocabulary whose file names none.
_SENTENCEPIECE_DEFAULT_IDS = {"bos_token": 1, "eos_token": 2, "unk_token": 0}

_FIX = "use the model's Hugging Face directory instead"


def build_tokenizer(metadata: Mapping[str, Any]) -> PreTrainedTokenizerFast:
    """The tokenizer that `metadata` (a GGUF file's key/value metadata) describes.

    Raises ModelLoadError when the file describes a tokenizer we cannot rebuild.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(f"unsupported tokenizer.ggml.model {kind!r} in the GGUF file: {_FIX}")
    tokens = _tokens(metadata)
    token_types = _token_types(metadata, tokens)
    ids = _special_token_ids(metadata, len(tokens), _SENTENCEPIECE_DEFAULT_IDS if kind == "llama" else {})
    if kind == "gpt2":
        backend, default_add_bos = _byte_level_bpe(metadata, tokens)
    else:
        unk = tokens[ids["unk_token"]] if "unk_token" in ids else None
        backend, default_add_bos = _sentencepiece_bpe(metadata, tokens, unk), True
    _add_whole_tokens(backend, tokens, token_types)

    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    for name, wanted in (("bos", add_bos), ("eos", add_eos)):
        if wanted and f"{name}_token" not in ids:
            raise ModelLoadError(
                f"the GGUF file asks for a {name.upper()} token on every prompt but has no valid "
                f"tokenizer.ggml.{name}_token_id: {_FIX}"
            )
    # Set on the backend, not through transformers' `add_bos_token`/`add_eos_token` (which rebuild the template
    # from a whitespace-split string), so `tokenizer.add_bos_token` reads False even when BOS is added.
    backend.post_processor = _bos_eos_template(
        tokens, ids["bos_token"] if add_bos else None, ids["eos_token"] if add_eos else None
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        **{name: tokens[token_id] for name, token_id in ids.items()},
        chat_template=metadata.get("tokenizer.chat_template"),
    )


def _tokens(metadata: Mapping[str, Any]) -> list[str]:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"the GGUF file has no tokenizer.ggml.tokens (no vocabulary): {_FIX}")
    # llama.cpp renames empty tokens so that every id keeps a distinct, non-empty text.
    tokens = [token or f"[EMPTY_{index}]" for index, token in enumerate(tokens)]
    if len(set(tokens)) != len(tokens):
        raise ModelLoadError(
            f"the GGUF file's tokenizer.ggml.tokens has duplicate tokens (llama.cpp rejects it): {_FIX}"
        )
    return tokens


def _token_types(metadata: Mapping[str, Any], tokens: Sequence[str]) -> list[int]:
    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is None:
        return [int(TokenType.NORMAL)] * len(tokens)
    if len(token_types) < len(tokens):
        raise ModelLoadError(
            f"the GGUF file has {len(token_types)} tokenizer.ggml.token_type entries for {len(tokens)} tokens: {_FIX}"
        )
    return list(token_types)


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    return {token: index for index, token in enumerate(tokens)}


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: Sequence[str]) -> tuple[Tokenizer, bool]:
    """GPT-2 style byte-level BPE; also returns llama.cpp's add-BOS default for this pre-tokenizer."""
    raw_merges = metadata.get("tokenizer.ggml.merges")
    if not raw_merges:
        raise ModelLoadError(f"the GGUF file has a gpt2 tokenizer but no tokenizer.ggml.merges: {_FIX}")
    pre = metadata.get("tokenizer.ggml.pre")
    if not pre:
        # llama.cpp warns too: the converter did not know the model's pre-tokenizer, so tokens may be off.
        logger.warning("the GGUF file has no tokenizer.ggml.pre: splitting text as llama.cpp's 'default' does")
        pre = "default"
    spec = _PRE_TOKENIZERS.get(pre)
    if spec is None:
        logger.warning("unknown tokenizer.ggml.pre %r: splitting text with the GPT-2 regex, tokens may differ", pre)
        spec = _GPT2_FAMILY

    vocab = _vocab(tokens)
    merges = []
    for merge in raw_merges:
        # llama.cpp cuts a merge at the first space after its first character, so a part may start with a space.
        left, _, right = merge[1:].partition(" ")
        left = merge[:1] + left
        # tokenizers panics on a merge whose parts or result are not tokens; llama.cpp could never emit those anyway.
        if left in vocab and right in vocab and left + right in vocab:
            merges.append((left, right))

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in spec.regexes]
        # The regexes did the splitting; this only maps bytes to the GPT-2 alphabet the vocabulary is written in.
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend, spec.add_bos


def _sentencepiece_bpe(metadata: Mapping[str, Any], tokens: Sequence[str], unk: str | None) -> Tokenizer:
    """Sentencepiece-style BPE: merges ranked by score, byte fallback, spaces written as "▁"."""
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) < len(tokens):
        raise ModelLoadError(f"the GGUF file has a llama tokenizer without a score for every token: {_FIX}")

    vocab = _vocab(tokens)
    # llama.cpp joins the adjacent pair whose joined text is the highest-scoring token, over and over. Listing
    # every way to cut each token into two tokens, best score first, gives BPE the same order of merges.
    ranked = []
    for token, score in zip(tokens, scores, strict=False):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[token], vocab[left], left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # A normalizer (not Metaspace) because llama.cpp adds the space prefix to every piece of text that follows a
    # special token, and tokenizers normalizes each such piece on its own.
    backend.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(_SPACE)] if add_space_prefix else []) + [normalizers.Replace(" ", _SPACE)]
    )
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])
    )
    return backend


def _add_whole_tokens(backend: Tokenizer, tokens: Sequence[str], token_types: Sequence[int]) -> None:
    """Make control, unknown and user-defined tokens match whole in the raw text, as llama.cpp does.

    Control and unknown tokens are special (decoding with skip_special_tokens drops them); user-defined are not.
    """
    # Plain ints: comparing 100k+ ids with the IntEnum members directly is slow enough to show in the build time.
    special_types, user_defined_type = {int(TokenType.CONTROL), int(TokenType.UNKNOWN)}, int(TokenType.USER_DEFINED)
    special, user_defined = [], []
    for token, token_type in zip(tokens, token_types, strict=False):
        if token_type in special_types:
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == user_defined_type:
            user_defined.append(AddedToken(token, special=False, normalized=False))
    # Each is already in the vocabulary, so it keeps its id.
    backend.add_special_tokens(special)
    backend.add_tokens(user_defined)


def _special_token_ids(metadata: Mapping[str, Any], n_tokens: int, defaults: Mapping[str, int]) -> dict[str, int]:
    """{"bos_token": id, ...} for the special tokens the file (or llama.cpp's default) names."""
    ids = {}
    for name, key in _SPECIAL_TOKEN_KEYS.items():
        token_id = metadata.get(key, defaults.get(name))
        if token_id is None:
            continue
        if not 0 <= token_id < n_tokens:
            # llama.cpp does not use an id outside the vocabulary either.
            logger.warning("ignoring %s = %d: the vocabulary has only %d tokens", key, token_id, n_tokens)
            continue
        ids[name] = token_id
    return ids


def _bos_eos_template(tokens: Sequence[str], bos_id: int | None, eos_id: int | None) -> processors.TemplateProcessing:
    """Adds BOS/EOS (when given) on `tokenizer(text)`; `add_special_tokens=False` skips the template entirely."""
    # The template names the tokens by key ("bos", "eos") and the texts go separately: a token text with a space
    # or a colon would not parse as a template piece.
    added = {key: token_id for key, token_id in (("bos", bos_id), ("eos", eos_id)) if token_id is not None}

    def sequence(name: str, type_id: int) -> list[str]:
        pieces = [f"${name}:{type_id}"]
        if "bos" in added:
            pieces.insert(0, f"bos:{type_id}")
        if "eos" in added:
            pieces.append(f"eos:{type_id}")
        return pieces

    return processors.TemplateProcessing(
        single=sequence("A", 0),
        pair=sequence("A", 0) + sequence("B", 1),
        special_tokens=[
            {"id": key, "ids": [token_id], "tokens": [tokens[token_id]]} for key, token_id in added.items()
        ],
    )
