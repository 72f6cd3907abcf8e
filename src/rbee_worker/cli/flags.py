"""The command line's parser: `rbee-worker`'s commands and their flags, each value checked against its range."""

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from rbee_worker import __version__
from rbee_worker.benchmark.peers import CONCURRENCY, PEERS, SAMPLING, WORKER_PEERS
from rbee_worker.cli.commands import run_bench, run_generate
from rbee_worker.cli.exits import EXIT_USAGE, fail
from rbee_worker.cli.serve import run_serve
from rbee_worker.engine.engine_config import REASONING_PARSERS
from rbee_worker.logs import LOG_FORMATS


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as the contract's one line `error: ...` with exit code 2."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see `{self.prog} --help`)", EXIT_USAGE)


def bounded(kind: type, low: float | None = None, high: float | None = None, low_open: bool = False) -> Callable:
    """An argparse type that also checks the contract's range for the value."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high):
            left = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"{text} is outside {left}{low}, {high if high is not None else '∞'}]")
        return value

    return parse


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and device")
    group.add_argument(
        "--model",
        default="demo",
        help="HF model directory, .gguf file, hub id in the local cache, "
        "or `demo` (SmolLM2-135M-Instruct Q4_1, fetched into the user cache on first use)",
    )
    group.add_argument("--device", default=None, help="auto|cpu|cuda|cuda:N|mps (or N with --backend)")
    group.add_argument("--backend", choices=["cpu", "cuda", "mps"], help="seed-style device family; --device N picks")
    group.add_argument("--cuda-device", type=bounded(int, 0), metavar="N", help="same as --device cuda:N")
    group.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on CUDA (float16 before Ampere), float16 on MPS; on a CPU bfloat16 where it has "
        "bfloat16 instructions (AVX512_BF16, AMX, ARM BF16), float32 elsewhere (the `cpu` line of the log says which)",
    )
    group.add_argument(
        "--quantize",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="weight-only quantized linear layers: on the CPU in any --dtype (the kernels compute in bfloat16), on a "
        "CUDA GPU of compute capability 8.0+ in bfloat16. "
        "auto (default): a GGUF file keeps its own quantized matrices (Q4_* as int4, Q8_0 / Q5_K / Q6_K as int8) "
        "where those kernels run, unless --dtype float32 or float16 is given, and is dequantized to --dtype elsewhere; "
        "a model directory loads as it is. "
        "int8 / int4: a model directory is quantized at load (int8 per row, int4 per group of 32; embedding and LM "
        "head stay); a GGUF file keeps its own types. none: every weight in --dtype",
    )
    group.add_argument(
        "--runtime",
        default="auto",
        choices=["auto", "torch", "llama.cpp"],
        help="what runs the model: llama.cpp's runtime (llama-cpp-python; GGUF files on cpu or mps, in the file's own "
        "types) or torch (transformers' model classes). auto (default): llama.cpp for a GGUF file on cpu or mps where "
        "llama-cpp-python is installed, torch otherwise, or where --dtype, --quantize (other than auto) or --compile "
        "is given, which only torch honours (llama.cpp refuses them)",
    )
    group.add_argument(
        "--threads",
        type=bounded(int, 1),
        default=None,
        metavar="N",
        help="CPU threads of the forward (default: OMP_NUM_THREADS where set, else the physical cores)",
    )
    group.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant mode: a request's tokens never depend on other running requests",
    )


def add_log_flags(parser: argparse.ArgumentParser, default_level: str) -> None:
    group = parser.add_argument_group("logs")
    group.add_argument(
        "--log-level",
        default=default_level,
        choices=["debug", "info", "warning", "error"],
        help=f"default: {default_level}",
    )
    group.add_argument(
        "--log-format", choices=LOG_FORMATS, default=None, help="default: json, or pretty when stderr is a terminal"
    )


def build_parser() -> Parser:
    parser = Parser(prog="rbee-worker", description="LLM inference worker for the rbee pool manager.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    generate = commands.add_parser("generate", help="generate text for one prompt and stream it to stdout")
    add_model_flags(generate)
    add_log_flags(generate, "warning")
    sampling = generate.add_argument_group("generation")
    sampling.add_argument("--prompt", required=True, help="the prompt (raw text, or the user message with --chat)")
    sampling.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    sampling.add_argument("--max-tokens", type=bounded(int, 1, 2048), default=256, help="1..2048 (default 256)")
    sampling.add_argument("--temperature", type=bounded(float, 0.0, 2.0), default=1.0, help="0..2; 0 is greedy")
    sampling.add_argument("--top-k", type=bounded(int, 0), default=0, help="0 is off")
    sampling.add_argument("--top-p", type=bounded(float, 0.0, 1.0), default=1.0)
    sampling.add_argument("--min-p", type=bounded(float, 0.0, 1.0), default=0.0)
    sampling.add_argument("--repetition-penalty", type=bounded(float, 0.0, 2.0, low_open=True), default=1.0)
    sampling.add_argument("--presence-penalty", type=bounded(float, -2.0, 2.0), default=0.0)
    sampling.add_argument("--frequency-penalty", type=bounded(float, -2.0, 2.0), default=0.0)
    sampling.add_argument("--seed", type=bounded(int, 0, 2**64 - 1), default=None, help="default: random, reported")
    sampling.add_argument(
        "--stop",
        nargs="+",
        action="extend",
        default=[],
        metavar="STR",
        help="stop strings (up to 4), matched across token boundaries",
    )
    sampling.add_argument(
        "--json", action="store_true", help="print only one JSON summary line at the end instead of streaming text"
    )
    generate.set_defaults(run=run_generate)

    serve = commands.add_parser("serve", help="serve the model over HTTP and register with the pool manager")
    add_model_flags(serve)
    add_log_flags(serve, "info")
    jobs = serve.add_argument_group("jobs")
    jobs.add_argument(
        "--max-batch",
        type=bounded(int, 1),
        default=16,
        metavar="N",
        help="jobs that run at once, sharing the KV block pool (default 16); when the pool runs out of free blocks, "
        "the newest running job is preempted (its blocks freed, its tokens computed again later)",
    )
    jobs.add_argument(
        "--max-queue",
        type=bounded(int, 0),
        default=64,
        metavar="N",
        help="jobs that may wait for a running slot (default 64); beyond that, 503 ALL_SLOTS_BUSY",
    )
    jobs.add_argument(
        "--max-context",
        type=bounded(int, 1),
        default=None,
        metavar="TOKENS",
        help="cap the context (prompt + generated tokens) below the model's own",
    )
    jobs.add_argument(
        "--cache-ram",
        type=bounded(float, 0.0),
        default=None,
        metavar="GIB",
        help="host memory for the llama.cpp runtime's prompt cache (finished requests' saved KV states, reused by "
        "prompts that share their prefix; as llama-server's --cache-ram); 0 turns it off (default: as much as the KV "
        "cache, at most 8 GiB); reported in /health's prompt_cache_bytes and rbee:memory_bytes{part=prompt_cache}",
    )
    jobs.add_argument(
        "--kv-cache-gb",
        type=bounded(float, 0.0, low_open=True),
        default=None,
        metavar="GIB",
        help="memory for the KV cache: one pool of KV blocks (--block-size positions each) shared by all running jobs, "
        "each holding the blocks of its own tokens, and never more than --max-batch whole contexts take; the context "
        "offered per job is the model's own (or --max-context) whenever one job fits in the pool, else what the pool "
        "holds (default: 90%% of the GPU memory left after the weights; on a CPU half the available memory, touched "
        "only as contexts grow)",
    )
    jobs.add_argument(
        "--block-size",
        type=bounded(int, 1),
        default=16,
        metavar="TOKENS",
        help="token positions per KV block (default 16; a power of two is usual): the unit that jobs take from the "
        "pool, and that the prefix cache reuses (only whole blocks of a prompt are found there)",
    )
    jobs.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="compute every prompt in full; by default a prompt's leading whole blocks whose tokens an earlier job "
        "computed (a shared system prompt, a conversation's earlier turns) are reused from the KV blocks it left, not "
        "computed again (usage.prompt_tokens_details.cached_tokens, the end event's cached_tokens)",
    )
    jobs.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay batched decode steps as CUDA graphs on a GPU (default on; never with --deterministic)",
    )
    jobs.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the model through torch.compile, compiled before the worker reports ready: each decoder layer on "
        "CUDA, inside the CUDA graphs (the default there, unless --no-cuda-graphs or --deterministic: a longer "
        "start-up, then faster decoding and a shorter time to first token), the whole model for decode steps on the "
        "CPU (off by default there: a much longer start-up, longest while inductor's cache is cold, then faster "
        "decoding); figures in bench/results/README.md",
    )
    jobs.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEXT",
        help="a Jinja chat template (a file, or the template itself) instead of the model's own",
    )
    jobs.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default="auto",
        help="auto (default): a chat template that writes <think> marks a reasoning model, whose reasoning goes to "
        "reasoning_content, apart from content, and whose response_format and tool grammars apply after it; none: "
        "the reasoning stays in content",
    )
    jobs.add_argument(
        "--grammar-compile-timeout",
        type=bounded(float, 0.0, low_open=True),
        default=10.0,
        metavar="SECONDS",
        help="a response_format or tool-call grammar that takes longer to compile is refused with a 400 naming its "
        "field, and its compilation stopped (default 10)",
    )
    jobs.add_argument(
        "--drain-timeout",
        type=bounded(float, 0.0),
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT/POST /shutdown, let running jobs finish this long, then cancel them (default 30)",
    )
    jobs.add_argument(
        "--stall-timeout",
        type=bounded(float, 0.0, low_open=True),
        default=120.0,
        metavar="SECONDS",
        help="/health says unhealthy when the engine has work and finishes no step this long (default 120)",
    )
    jobs.add_argument(
        "--unclaimed-job-timeout",
        type=bounded(float, 0.0, low_open=True),
        default=60.0,
        metavar="SECONDS",
        help="cancel a /v1/inference job whose stream is not opened this long (default 60)",
    )
    parallel = serve.add_argument_group("tensor parallelism")
    parallel.add_argument(
        "--tensor-parallel",
        "--tp",
        dest="tensor_parallel",
        type=bounded(int, 1),
        default=1,
        metavar="N",
        help="split the model over N processes in all (default 1: none), which this one starts (N / --nnodes on "
        "each node), joined by torch.distributed: attention heads, key/value heads and the MLP are split, each an "
        "N-th on each process (N must divide them). This version runs on the CPU (gloo; each process gets the "
        "physical cores / the node's ranks threads unless --threads is given), on the torch runtime, with float "
        "weights only; CUDA (NCCL, cuda:0..N-1 or --devices) is untested, CUDA graphs and --compile are off",
    )
    parallel.add_argument(
        "--devices",
        metavar="LIST",
        help="the CUDA devices of this node's ranks, comma separated (2,3: rank 0 on cuda:2, rank 1 on cuda:3); "
        "one per rank on this node (default: from --device's index upward)",
    )
    parallel.add_argument(
        "--nnodes",
        type=bounded(int, 1),
        default=1,
        metavar="K",
        help="nodes (hosts) the N ranks are spread over, N / K on each (default 1); each node runs this command with "
        "its own --node-rank, the same --tensor-parallel, --nnodes, --master-addr, --master-port and model",
    )
    parallel.add_argument(
        "--node-rank",
        type=bounded(int, 0),
        default=0,
        metavar="R",
        help="this node's number, 0..K-1 (default 0); node 0 serves HTTP and reports to the pool manager, the others "
        "bind no port and only run their ranks until node 0 stops",
    )
    parallel.add_argument(
        "--master-addr",
        default="127.0.0.1",
        metavar="HOST",
        help="node 0's address that every node reaches, for torch.distributed's TCP rendezvous (default 127.0.0.1)",
    )
    parallel.add_argument(
        "--master-port",
        type=bounded(int, 1, 65535),
        default=None,
        metavar="PORT",
        help="the rendezvous port on node 0 (default: 29500 with --nnodes above 1, else a free port)",
    )
    http = serve.add_argument_group("HTTP and pool manager")
    http.add_argument("--worker-id", help="default: <host name>-<port>")
    http.add_argument("--model-ref", help="the model name reported to clients (default: the model's own name)")
    http.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        metavar="NAME",
        help="names the OpenAI API answers to besides MODEL as given and the model's own name; the first is the name "
        "reported unless --model-ref is given",
    )
    http.add_argument(
        "--no-access-log", dest="access_log", action="store_false", help="no log line for each HTTP request"
    )
    http.add_argument(
        "--max-request-bytes",
        type=bounded(int, 1),
        default=None,
        metavar="BYTES",
        help="a larger request body gets 413 before it is read (default: the largest body a request whose prompt fits "
        "the context can have: context x the most bytes one token stands for x 6, JSON's longest escape of a byte, "
        "+ 1 MiB for the other fields; 64 MiB for a tokenizer whose tokens have no such bound)",
    )
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=bounded(int, 0, 65535), default=8080, help="0 picks a free port")
    http.add_argument("--callback-url", help="POST the ready callback here once the model is loaded")
    http.add_argument(
        "--callback-timeout",
        type=bounded(float, 0.0),
        default=60.0,
        metavar="SECONDS",
        help="retry the ready callback this long (default 60), then exit 3",
    )
    http.add_argument("--heartbeat-url", help="POST a heartbeat here every --heartbeat-interval seconds")
    http.add_argument("--heartbeat-interval", type=bounded(float, 0.1), default=30.0, metavar="SECONDS")
    http.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="allow a non-loopback --host without LLORCH_API_TOKEN",
    )
    serve.set_defaults(run=run_serve)

    bench = commands.add_parser(
        "bench",
        help="measure rbee-worker through its HTTP API against the peers",
        description="Measure rbee-worker (a `serve` process) through its HTTP API, and each of --peers on the same "
        "weights. The worker's work in each of --rounds: one warm-up stream, --repeats + 1 prompts of "
        "--prompt-tokens, then --repeats single streams and --repeats rounds of each --concurrency, every stream "
        "generating --gen-tokens: with the defaults (1 + 3 x (1 + 1+4+16+64)) x 128 = 33,152 generated tokens; each "
        "peer measures what it supports of the same (transformers: the prompts and the single streams). "
        "A quick look: --concurrency 1,4 --repeats 1 --peers= (the worker alone).",
    )
    add_log_flags(bench, "warning")
    bench.add_argument("--model", default="demo", help="as for serve (default: demo)")
    bench.add_argument("--device", default="cpu", help="as for serve (default: cpu)")
    bench.add_argument("--dtype", default="auto", help="as for serve (default: auto)")
    bench.add_argument(
        "--prompt-tokens",
        type=bounded(int, 1),
        default=512,
        help="the long prompt, for the time to first token (default: 512)",
    )
    bench.add_argument(
        "--gen-tokens", type=bounded(int, 2), default=128, help="tokens each measured stream generates (default: 128)"
    )
    bench.add_argument(
        "--concurrency",
        type=comma_list(int),
        default=CONCURRENCY,
        help=f"comma-separated stream counts for the aggregate tokens/s (default: {','.join(map(str, CONCURRENCY))})",
    )
    bench.add_argument(
        "--sampling",
        choices=list(SAMPLING),
        default="greedy",
        help="greedy, or chat: temperature 0.7 and top_p 0.9 (a chat client's usual settings), for every system "
        "(default: greedy)",
    )
    bench.add_argument(
        "--repeats",
        type=bounded(int, 1),
        default=3,
        help="runs of each measurement, reported as the median (default: 3)",
    )
    bench.add_argument(
        "--rounds",
        type=bounded(int, 1),
        default=1,
        help="measure the worker and the peers in turn this many times (medians) (default: 1)",
    )
    bench.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch / llama.cpp threads for the peers (default: the physical cores)",
    )
    bench.add_argument(
        "--peers",
        type=comma_list(str),
        default=["transformers"],
        help=f"comma-separated, from {', '.join([*PEERS, *WORKER_PEERS])}; empty: the worker alone "
        "(default: transformers)",
    )
    bench.add_argument(
        "--worker-flag", action="append", default=[], help="extra flag for `serve` (repeatable; default: none)"
    )
    bench.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the results (.json and .md) go (default: a new directory rbee-bench-<date>-<time> in the current "
        "directory; bench/results, the repository's recorded results, only when given)",
    )
    bench.set_defaults(run=run_bench)
    return parser


def comma_list(kind: type) -> Callable[[str], list]:
    return lambda text: [kind(item) for item in text.split(",") if item]
