"""What a request must be for the engine to run it on the loaded model: checked when it is submitted, before any event
(an invalid one gets one Error event, INVALID_REQUEST)."""

from rbee_worker.engine.request_types import Request
from rbee_worker.engine.sampling.sampler_state import MAX_TOP_LOGPROBS
from rbee_worker.loading.loaded import LoadedModel


class RequestError(ValueError):
    """A request the engine refuses before generating (the message says why)."""


def check_request(request: Request, loaded: LoadedModel, context: int, vocab_size: int) -> None:
    """Raise RequestError for a request that cannot run on this model: `context` the most tokens one request may hold
    (ServedModel.context_length), `vocab_size` the tokenizer's vocabulary."""
    if not request.prompt_ids:
        raise RequestError("the prompt is empty after tokenization")
    if request.max_tokens < 0:
        raise RequestError("max_tokens must be at least 0")
    if any(token >= vocab_size for token, _ in request.sampling.logit_bias):
        raise RequestError(f"logit_bias token ids must be below the vocabulary's {vocab_size}")
    if not request.embed and loaded.info.encoder:
        raise RequestError(
            f"{loaded.info.name} is an encoder model: it computes embeddings (POST /v1/embeddings) and "
            "generates no text"
        )
    if request.embed and (request.max_tokens != 0 or request.grammar is not None):
        raise RequestError("an embedding request generates nothing: max_tokens 0, no grammar")
    if request.embed and (unsupported := loaded.pooling.unsupported):
        raise RequestError(f"this model pools its embeddings by {unsupported}, which this worker does not compute")
    if request.prompt_logprobs is not None and not 0 <= request.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"prompt_logprobs must be in 0..{MAX_TOP_LOGPROBS}")
    if len(request.prompt_ids) + request.max_tokens > context:
        raise RequestError(
            f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_tokens}) exceeds the model's "
            f"context of {context} tokens; shorten the prompt or lower max_tokens"
        )
    if any(not s for s in request.stop):
        raise RequestError("stop strings must be non-empty")
    if request.grammar is not None and request.ignore_eos:
        raise RequestError("ignore_eos cannot go with a grammar, which ends the output where the grammar does")
