"""`rbee-worker generate`: one prompt through the engine, its text streamed to stdout, a summary at the end. Imported
by the CLI only when the command runs (it imports torch)."""

import argparse
import dataclasses
import json
import logging
import sys

from rbee_worker.api.request_settings import sampling_params
from rbee_worker.cli.model_flags import resolve_model
from rbee_worker.engine.engine import Engine
from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.request_types import End, Error, ErrorCode, Request, Token
from rbee_worker.errors import GenerationError
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.loaded import LoadedModel
from rbee_worker.loading.loader import load_spec

log = logging.getLogger("rbee_worker")


def generate(args: argparse.Namespace) -> int:
    """Load the model (probed once: cli/model_flags.py resolve_model), run the prompt, print the text as it comes (or
    one JSON object with --json); raises GenerationError for a request the engine refuses or fails."""
    placement = resolve_placement(args.device, args.dtype, args.backend, args.cuda_device)
    model = resolve_model(args, placement)

    prompt: tuple[int, ...] = ()  # --prompt's token ids, made once by `load`

    def load() -> LoadedModel:
        """The model with its context cut to this request (the prompt and --max-tokens, at most the model's own), so
        that the KV block pool holds what the request needs and no more."""
        nonlocal prompt
        loaded = load_spec(model)
        prompt = prompt_ids(loaded, args)
        needed = len(prompt) + args.max_tokens
        info = dataclasses.replace(loaded.info, context_length=min(loaded.info.context_length, needed))
        return dataclasses.replace(loaded, info=info)

    engine = Engine(load, EngineConfig(deterministic=args.deterministic, max_batch=1, threads=args.threads))
    try:
        info = engine.loaded.info
        log.info(
            "loaded %s (%s, %s) on %s (%s runtime) as %s in %.2f s, %d MiB of weights",
            info.name,
            info.format,
            info.architecture,
            info.device,
            info.runtime,
            str(info.dtype).removeprefix("torch."),
            info.load_seconds,
            info.weight_bytes >> 20,
        )
        request = Request(
            prompt_ids=prompt,
            max_tokens=args.max_tokens,
            sampling=sampling_params(args),
            seed=args.seed,
            stop=tuple(args.stop),
        )
        pieces: list[str] = []
        token_ids: list[int] = []
        for event in engine.stream(request):
            if isinstance(event, Token):
                pieces.append(event.text)
                token_ids.extend(event.token_ids)
                if not args.json:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
            elif isinstance(event, Error):
                raise GenerationError(event.message, invalid_request=event.code is ErrorCode.INVALID_REQUEST)
            elif isinstance(event, End):
                report(args.json, event, "".join(pieces), token_ids, engine)
    finally:
        engine.close()
    return 0


def prompt_ids(model: LoadedModel, args: argparse.Namespace) -> tuple[int, ...]:
    """--prompt's token ids: raw, or as the user's message in the model's chat template with --chat."""
    if args.chat:
        return model.tokenize_chat([{"role": "user", "content": args.prompt}])
    return model.tokenize(args.prompt)


def report(as_json: bool, end: End, text: str, token_ids: list[int], engine: Engine) -> None:
    """The end of a generation: one JSON object on stdout with --json, else a summary line on stderr."""
    if as_json:
        summary = {
            "text": text,
            "token_ids": token_ids,
            "prompt_tokens": end.prompt_tokens,
            "tokens_out": end.tokens_out,
            "stop_reason": end.stop_reason.value,
            "seed": end.seed,
        }
        print(json.dumps(summary, ensure_ascii=False))
        return
    rate = (end.tokens_out - 1) / end.decode_time_s if end.tokens_out > 1 and end.decode_time_s > 0 else 0.0
    print(file=sys.stdout)
    print(
        f"[{end.stop_reason.value}] {end.prompt_tokens} prompt tokens, {end.tokens_out} generated, {rate:.1f} tok/s, "
        f"seed {end.seed}; memory: {engine.loaded.info.weight_bytes / 2**20:.0f} MiB weights + "
        f"{engine.kv_cache_bytes() / 2**20:.1f} MiB KV cache (a context of {engine.model.context_length} tokens)",
        file=sys.stderr,
    )
