"""The HTTP thread's cost of one streamed token's SSE event: api/native.py's sse_data (orjson) against the standard
library's encoder doing the same, on an OpenAI completions chunk without and with logprobs 5.

    PYTHONPATH=src python bench/sse_encoding.py
"""

import json
import re
import statistics
import timeit
from collections.abc import Callable
from pathlib import Path

from rbee_worker.api.native import _SSE_LINE_BREAKS, sse_data
from rbee_worker.benchmark.run import machine

NUMBER, REPEATS = 20000, 7
TOP = {" hello": -0.12345679104328156, " world": -2.3456788063049316, " foo": -3.456789016723633}
TOP |= {" bar": -4.567890167236328, " baz": -5.678901195526123}
LOGPROBS = {"tokens": [" hello"], "token_logprobs": [-0.12345679104328156], "top_logprobs": [TOP], "text_offset": [123]}
CHUNK = {"id": "cmpl-" + "0123456789abcdef" * 2, "object": "text_completion", "created": 1764316800, "model": "m8b"}
CHUNKS = {
    "plain": CHUNK | {"choices": [{"index": 0, "text": " hello", "logprobs": None, "finish_reason": None}]},
    "logprobs 5": CHUNK | {"choices": [{"index": 0, "text": " hello", "logprobs": LOGPROBS, "finish_reason": None}]},
}


def standard_library(payload: object) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_SSE_LINE_BREAKS)}\n\n"


def microseconds(encode: Callable[[object], str], payload: object) -> float:
    return statistics.median(timeit.repeat(lambda: encode(payload), number=NUMBER, repeat=REPEATS)) / NUMBER * 1e6


def main() -> None:
    result: dict = {"machine": machine(), "us_per_event": {}}
    lines = ["| chunk | json.dumps us | sse_data (orjson) us | ratio |", "|---|---|---|---|"]
    for name, chunk in CHUNKS.items():
        assert json.loads(sse_data(chunk)[6:]) == json.loads(standard_library(chunk)[6:])
        old, new = microseconds(standard_library, chunk), microseconds(sse_data, chunk)
        result["us_per_event"][name] = {"json.dumps": old, "sse_data": new}
        lines.append(f"| {name} | {old:.2f} | {new:.2f} | {old / new:.1f}x |")
    print("\n".join(lines))
    cpu = "_".join(re.sub(r"\(R\)|\(TM\)|[^\w.-]", " ", result["machine"]["cpu"]).split())
    out = Path("bench/results/sse_encoding") / f"sse_encoding_{cpu}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
