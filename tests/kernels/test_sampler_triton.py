"""The Triton kernels of kernels/sampler_triton.py against the sampler's tensor path (engine/sampling/sampler.py): the
draw against `_draw` of `_kept_weights` (the radix select of selection.py), the same token for every row, over mixes of
settings, flat and peaked rows, ties at the cuts, bfloat16 and float32 logits and invalid rows; the penalties
against `_penalized` on the CPU, bit for bit (elementwise float32 products round alike on every device).

On a GPU the kernels run compiled; everywhere else Triton's interpreter runs them on the CPU, in a child process
(the interpreter is chosen when Triton is imported), with numpy's exp in place of libdevice's.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import penalty_state

from rbee_worker.engine.sampling import sampler, sampler_state, seeded_draws
from rbee_worker.engine.sampling.sampler_state import SamplerFeatures, SamplerState
from rbee_worker.engine.sampling.sampling_params import SamplingParams

SETTINGS = [
    SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
    for t, k, p, m in [
        (0.7, 0, 0.9, 0.0), (0.3, 0, 0.9, 0.0), (1.0, 50, 1.0, 0.0), (1.5, 5, 0.5, 0.05), (0.7, 0, 1.0, 0.05),
        (1.0, 2000, 0.99, 0.0), (0.7, 64, 1.0, 0.0), (2.0, 0, 0.999, 0.0), (0.0, 0, 1.0, 0.0), (1.0, 0, 0.2, 0.0),
        (0.7, 1, 0.9, 0.0), (1.0, 0, 0.0, 0.0),
    ]
]  # fmt: skip
FEATURES = [SamplerFeatures(sampling=True), SamplerFeatures(filters=True), SamplerFeatures(top_k=True)]


def compare_with_tensor_path(device: str, rows: int, vocab: int, trials: int) -> int:
    """Draws each trial's rows by both paths under each stage set of FEATURES; returns how many draws were compared.
    Odd trials round the logits (ties, at the cuts too) and spread them more; trial 2 makes one row flat, one row
    NaN and one row all -inf."""
    from rbee_worker.kernels import sampler_triton

    generator = torch.Generator().manual_seed(vocab)
    state = SamplerState(rows, vocab, device)
    slots = torch.arange(rows, device=device)
    compared = 0
    for trial in range(trials):
        for slot in range(rows):
            # A stride of 7 (prime to the 12 settings): over four trials, six rows still meet every setting.
            state.assign(slot, SETTINGS[(7 * trial + slot) % len(SETTINGS)], 2**63 + 977 * trial + slot, [])
        logits = torch.randn(rows, vocab, generator=generator) * (1.0 + 3 * (trial % 3))
        if trial % 2:
            logits = logits.round()
        if trial == 2:
            logits[0] = 0.0
            logits[1, 7] = torch.nan
            logits[2] = -torch.inf
        logits = logits.to(device=device, dtype=torch.bfloat16 if trial % 2 else torch.float32)
        for features in FEATURES:
            x, top, _, valid = sampler._scores(logits, state, slots, features)
            bits = seeded_draws.draw_bits(state.stream[slots], state.counter[slots] + trial)
            expected = sampler._draw(sampler._kept_weights(x, top, state, slots, features), bits[:, None])
            drawn = sampler_triton.draw(
                x, top, state.temperature[slots], state.top_k[slots] if features.top_k else None,
                state.top_p[slots] if features.filters else None, state.min_p[slots], bits,
            )  # fmt: skip
            assert ((drawn >= 0) & (drawn < vocab)).all(), (trial, features)
            mismatch = (drawn != expected) & valid
            assert not mismatch.any(), (trial, features, mismatch.nonzero().tolist())
            compared += int(valid.sum())
    return compared


def compare_penalties(device: str, vocab: int) -> int:
    """Penalized logits of both paths for rows of every penalty kind, bfloat16 and float32 logits, with values
    that the penalties push past float32's range; returns how many logits were compared."""
    from rbee_worker.kernels import sampler_triton

    generator = torch.Generator().manual_seed(vocab)
    state, slots = penalty_state(vocab, generator)
    compared = 0
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(len(slots), vocab, generator=generator) * 4).to(dtype)
        x[:, :8] = torch.tensor([3.0e38, -3.0e38, 0.0, -0.0, 1e-30, -torch.inf, 2.5, -2.5]).to(dtype)
        expected = sampler._penalized(x, state, slots)
        on = {name: getattr(state, name).to(device) for name in ("counts", "repetition", "presence", "frequency")}
        got = sampler_triton.penalize(
            x.to(device), on["counts"], slots.to(device), on["repetition"], on["presence"], on["frequency"],
            sampler_state.IN_PROMPT,
        ).cpu()  # fmt: skip
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (got - expected).abs().max()
        compared += got.numel()
    return compared


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    import triton
    import triton.language as tl

    from rbee_worker.kernels import sampler_triton

    @triton.jit
    def _relative_probabilities(s_ptr, e_ptr, n, BLOCK: tl.constexpr):
        """exp(s) as the kernels' weights compute it."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        _, e = sampler_triton._weights(tl.load(s_ptr + i, mask=i < n))
        tl.store(e_ptr + i, e, mask=i < n)


@CUDA
@pytest.mark.parametrize(("rows", "vocab"), [(16, 4096), (8, 50_000), (3, 128_256)])
def test_compiled_kernels_draw_the_tokens_of_the_tensor_path(rows: int, vocab: int) -> None:
    assert compare_with_tensor_path("cuda", rows, vocab, trials=6) > 0


@CUDA
@pytest.mark.parametrize("vocab", [4096, 128_256])
def test_compiled_penalties_equal_the_tensor_path(vocab: int) -> None:
    assert compare_penalties("cuda", vocab) > 0


@CUDA
def test_libdevice_exp_equals_torch_exp_on_every_float_the_weights_use() -> None:
    """The weights are floor(2**40 * exp(s)) for s in [-64, 0]: the kernels' exp (libdevice's expf) must round as
    torch.exp does on CUDA, for each of those 1.1e9 float32 values, for the draws to be the tensor path's."""
    last = int(torch.tensor(64.0).view(torch.int32))  # the bits of 64.0; with the sign bit, -64.0
    step = 1 << 27
    for start in range(0, last + 1, step):
        bits = torch.arange(start, min(start + step, last + 1), device="cuda", dtype=torch.int64) - 2**31
        s = bits.to(torch.int32).view(torch.float32)  # -0.0 .. -64.0
        e = torch.empty_like(s)
        _relative_probabilities[(triton.cdiv(s.numel(), 4096),)](s, e, s.numel(), BLOCK=4096)
        assert torch.equal(e.view(torch.int32), torch.exp(s).view(torch.int32)), start


def test_interpreted_kernels_give_what_the_tensor_path_gives() -> None:
    """The kernels' logic on a machine without a GPU: a vocabulary of three chunks, the last one partial; six rows, as
    the interpreter runs one row's program at a time."""
    pytest.importorskip("triton")
    check = (
        "import sys; sys.path[:0] = sys.argv[1:]; import test_sampler_triton as t; "
        "print(t.compare_with_tensor_path('cpu', 6, 9000, trials=4) + t.compare_penalties('cpu', 9000))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", check, *map(str, Path(__file__).parents[:2])],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 100
