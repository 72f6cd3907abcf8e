"""Write a GGUF file in another llama.cpp type, through llama.cpp's own quantizer (llama-cpp-python's
`llama_model_quantize`, requantizing quantized tensors where needed), to measure the llama.cpp runtime on the types
people download (Q4_0, Q4_K_M, Q8_0) with the demo model alone on the machine. Requantizing an already quantized
file loses accuracy: the files are for timing, not for answers.

    python bench/requantize_gguf.py [--model demo] --type Q4_0 --out /tmp/demo-Q4_0.gguf
"""

import argparse
import ctypes

import llama_cpp.llama_cpp as native

from rbee_worker.loading.loader import resolve_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--type", required=True, help="a llama.cpp file type: Q4_0, Q4_K_M, Q8_0, ...")
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=0, help="0: llama.cpp's default")
    args = parser.parse_args()
    ftype = getattr(native, f"LLAMA_FTYPE_MOSTLY_{args.type.upper()}", None)
    if ftype is None:
        parser.error(f"llama.cpp has no file type {args.type!r}")
    params = native.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, args.threads
    source = str(resolve_model_path(args.model)).encode()
    if native.llama_model_quantize(source, args.out.encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not write {args.out}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
