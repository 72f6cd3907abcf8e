"""POST /v1/embeddings (CONTRACT.md §4), as OpenAI's: one embedding per input (a text or token ids), each an engine
request that computes its prompt and pools its hidden states as the model's sentence-transformers config says
(loading/pooling.py), batched in the engine with every other request; floats or base64 (little-endian float32),
cut to `dimensions` where the model is a Matryoshka model, normalized where the model normalizes."""

import base64
import uuid
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from rbee_worker.api.admission import AdmissionError, admit_all, rendering_route
from rbee_worker.api.api_error import ApiError
from rbee_worker.api.choices import collect
from rbee_worker.api.openai import ERRORS, openai_error
from rbee_worker.api.openai_requests import (
    check_capacity,
    check_fits,
    check_model,
    check_token_ids,
    context_exceeded,
)
from rbee_worker.api.openai_schema import MAX_CHOICES
from rbee_worker.api.state import WorkerState
from rbee_worker.engine.request_types import Request as EngineRequest
from rbee_worker.loading.pooling import finished


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)]
    ) = Field(description=f"a text, token ids, or up to {MAX_CHOICES} of either: one embedding each, in order")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="a Matryoshka model's first dimensions only")
    user: str | None = None

    @property
    def inputs(self) -> list[str] | list[list[int]]:
        given = self.input
        return given if isinstance(given, list) and not isinstance(given[0], int) else [given]  # type: ignore[list-item]


def embeddings_router(state: WorkerState) -> APIRouter:
    router = APIRouter(
        tags=["OpenAI-compatible"], route_class=rendering_route((AdmissionError, ApiError), openai_error)
    )

    @router.post("/v1/embeddings", responses={**ERRORS, 500: ERRORS[400] | {"description": "inference failed"}})
    async def embeddings(body: EmbeddingRequest, http_request: Request) -> JSONResponse:
        pooling = None

        def build() -> list[EngineRequest]:
            nonlocal pooling
            check_model(state, body.model)
            check_capacity(state, len(body.inputs), "input")
            pooling = state.engine.loaded.pooling
            if pooling.unsupported:
                raise ApiError(400, f"this model pools its embeddings by {pooling.unsupported}, which this worker "
                               "does not compute", param="model")  # fmt: skip
            if body.dimensions is not None and not pooling.matryoshka:
                raise ApiError(400, "dimensions: this model's embeddings have one size (it is no Matryoshka model)",
                               param="dimensions")  # fmt: skip
            return [embedding_request(state, prompt, http_request) for prompt in body.inputs]

        jobs = [job.events for job in await admit_all(state, build, http_request)]
        generations = await collect(jobs, http_request)
        assert pooling is not None
        data, tokens = [], 0
        for index, generation in enumerate(generations):
            assert generation.embedding is not None and generation.end is not None
            vector = np.asarray(generation.embedding, dtype=np.float32)
            if body.dimensions is not None and body.dimensions > len(vector):
                raise ApiError(400, f"dimensions: at most {len(vector)} for this model", param="dimensions")
            vector = finished(vector, pooling.normalize, body.dimensions)
            encoded = (base64.b64encode(vector.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
                       else vector.tolist())  # fmt: skip
            data.append({"object": "embedding", "index": index, "embedding": encoded})
            tokens += generation.end.prompt_tokens
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return JSONResponse({"object": "list", "data": data, "model": state.model_name, "usage": usage})

    return router


def embedding_request(state: WorkerState, prompt: str | list[int], http_request: Request) -> EngineRequest:
    """The engine request of one input: its prompt computed and pooled, nothing generated."""
    if isinstance(prompt, list):
        ids = check_token_ids(state, prompt, "input")
    else:
        check_fits(state, prompt, 0, "input")
        ids = state.engine.model.tokenize(prompt)
    if not ids:
        raise ApiError(400, "input: an input is empty", param="input")
    if len(ids) > (context := state.engine.model.context_length):
        raise context_exceeded(context, f"{len(ids)} in the input", "input")
    return EngineRequest(
        prompt_ids=ids,
        max_tokens=0,
        embed=True,
        request_id=f"embd-{uuid.uuid4().hex}",
        correlation_id=getattr(http_request.state, "correlation_id", None),
    )
