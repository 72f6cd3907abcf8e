"""Response bodies of the native API (CONTRACT.md §2) for the OpenAPI document; request bodies come from
validation.job_request_schema, the same table the validation runs on."""

from typing import Any, Literal

from pydantic import BaseModel

from rbee_worker.api.native_validation import job_request_schema


class CpuInfo(BaseModel):
    """What the worker's CPU paths are chosen by (hardware/cpu_features.py)."""

    arch: str  # x86_64, aarch64, arm64, ...
    isa: str  # the vector level torch's kernels dispatch to: avx512, avx2, default, ...
    flags: list[str]  # the instruction-set flags that decide a path (AVX2, AVX-512 BW/VL/DQ, AVX512_BF16, AMX, ...)
    bf16: Literal["native", "onednn", "emulated"]  # bf16 instructions; oneDNN's bf16 without them; neither
    forced: str | None  # RBEE_CPU_ISA, when set


class Health(BaseModel):
    status: Literal["healthy", "loading", "draining", "unhealthy"]
    worker_id: str
    # Absent while loading:
    state: Literal["idle", "busy"] | None = None
    model: str | None = None
    device: str | None = None  # where the model runs: cpu, cuda:0, mps
    devices: list[str] | None = None  # every process's device, in rank order (more than one: tensor parallelism)
    dtype: str | None = None  # what the model computes in (bfloat16, float32, ...); quantized weights keep their types
    vram_bytes: int | None = None  # memory_bytes on a GPU, 0 elsewhere (CONTRACT.md §2): device says which
    memory_bytes: int | None = None  # weights + KV cache, measured (on a GPU: what torch has allocated); all ranks
    weight_bytes: int | None = None  # the weights as held (llama.cpp: llama_model_size)
    # what one token's forward reads of them: a mixture of experts' routed experts only (a dense model's all)
    active_weight_bytes: int | None = None
    kv_cache_bytes: int | None = None  # the KV cache in memory (llama.cpp, GPU: all of it, allocated at start)
    prompt_cache_bytes: int | None = None  # host memory of llama.cpp's saved prompt states (--cache-ram); torch: 0
    runtime: Literal["torch", "llama.cpp"] | None = None  # what runs the model (--runtime)
    slots_total: int | None = None  # --max-batch
    slots_busy: int | None = None  # jobs holding a slot (others in flight wait in the queue)
    kv_cache_usage_perc: float | None = None  # share of the KV cache's blocks that running jobs hold, 0..1
    cpu: CpuInfo | None = None
    message: str | None = None  # why it is unhealthy


class Ready(BaseModel):
    ready: bool
    state: Literal["loading", "idle", "busy", "draining", "error"]
    model_loaded: bool
    progress_url: str | None = None


class JobCreated(BaseModel):
    job_id: str
    sse_url: str


class FieldErrorBody(BaseModel):
    field: str
    constraint: str
    message: str
    value: str | None = None


class FieldErrors(BaseModel):
    errors: list[FieldErrorBody]


class ErrorDetail(BaseModel):
    code: str
    message: str
    slots_total: int | None = None  # ALL_SLOTS_BUSY only, with:
    slots_busy: int | None = None
    queue_total: int | None = None
    queue_busy: int | None = None


class NativeError(BaseModel):
    error: ErrorDetail


class ShutdownAccepted(BaseModel):
    status: Literal["draining"]


# One server-sent event: its `data` is a JSON object, or the text [DONE] that ends a job stream.
SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
    "required": ["data"],
}


def sse_response_doc(description: str) -> dict[str, Any]:
    return {"content": {"text/event-stream": {"schema": SSE_EVENT}}, "description": description}


def json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


UNAUTHORIZED = {401: {"model": NativeError, "description": "MISSING_API_KEY or INVALID_API_KEY (LLORCH_API_TOKEN)"}}
JOB_ERRORS = {
    **UNAUTHORIZED,
    400: {"model": FieldErrors, "description": "every validation error, in the contract's table order"},
    409: {"model": FieldErrors, "description": "job_id is already running"},
    503: {"model": NativeError, "description": "LOADING, DRAINING or ALL_SLOTS_BUSY (with Retry-After)"},
}
EXECUTE_BODY = json_body(job_request_schema(require_job_id=True))
INFERENCE_BODY = json_body(job_request_schema(require_job_id=False))
CANCEL_BODY = json_body(
    {"type": "object", "properties": {"job_id": {"type": "string", "minLength": 1}}, "required": ["job_id"]}
)
