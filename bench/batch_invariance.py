"""How often a seeded sampled request's tokens change when 15 others run beside it, with and without --deterministic.

Each of 16 seeded chat requests (temperature 0.7, top_p 0.9) runs alone, then all 16 run together; a request whose
tokens differ between the two counts. The sampler's draws depend on (seed, step) alone, so without --deterministic a
difference comes from the batched forward's rounding (a near tie flipped), after which the texts part ways.

    PYTHONPATH=src python bench/batch_invariance.py --model demo --device cpu [--deterministic]

One mode per process (a GPU holds one copy of a large model); each run adds its mode to the JSON file.
"""

import argparse
import json
import re
from pathlib import Path

from rbee_worker.benchmark.run import machine
from rbee_worker.engine.engine import Engine
from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.request_types import End, Request, Token
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.loader import load_model, resolve_model_path

TEXT = "Once upon a time, in a small village by the sea, there lived"


def tokens_of(engine: Engine, requests: list[Request]) -> list[list[int]]:
    """Each request's token ids, all submitted at once."""
    import queue

    streams = [queue.SimpleQueue() for _ in requests]
    for request, events in zip(requests, streams, strict=True):
        engine.submit(request, events.put)
    results = []
    for events in streams:
        ids: list[int] = []
        while not isinstance(event := events.get(timeout=600), End):
            if isinstance(event, Token):
                ids.extend(event.token_ids)
        results.append(ids)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results/sampling"))
    args = parser.parse_args()
    path = str(resolve_model_path(args.model))
    placement = resolve_placement(args.device, args.dtype)
    chat = SamplingParams(temperature=0.7, top_p=0.9)
    machine_name = machine().get("gpu") or machine()["cpu"]
    stem = "_".join(re.sub(r"\(R\)|\(TM\)|[^\w.-]", " ", machine_name).split())
    out = args.out / f"batch_invariance_{Path(args.model).stem}_{args.device.replace(':', '')}_{stem}.json"
    result: dict = json.loads(out.read_text()) if out.exists() else {}
    result |= {"machine": machine(), "model": args.model, "device": args.device, "tokens": args.tokens}
    deterministic = args.deterministic
    engine = Engine(lambda: load_model(path, placement), EngineConfig(deterministic=deterministic, max_batch=16))
    try:
        requests = [
            Request(engine.model.tokenize(f"{TEXT} {i}"), max_tokens=args.tokens, sampling=chat, seed=1000 + i,
                    ignore_eos=True)
            for i in range(16)
        ]  # fmt: skip
        alone = [tokens_of(engine, [r])[0] for r in requests]
        together = tokens_of(engine, requests)
    finally:
        engine.close()
    differ = [i for i in range(16) if alone[i] != together[i]]
    first = [next(j for j, (a, b) in enumerate(zip(alone[i], together[i], strict=True)) if a != b) for i in differ]
    name = "deterministic" if deterministic else "default"
    result[name] = {"requests_differing": len(differ), "of": 16, "first_differing_token": first}
    print(name, json.dumps(result[name]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
