"""--compile: the model's forward through torch.compile, in place (`nn.Module.compile`), with dynamic shapes (one
compilation covers every batch size above one and every attention span; `ModelRunner.warm_up` runs each class of
forward once before ready). What is compiled depends on the device, as measured:

- CUDA: each decoder layer (PyTorch's "regional compilation"). The layers share one class and one forward, and with
  parameters as graph inputs (dynamo's default) they share one compiled code, so compiling takes about as long as
  one layer: 7.5 s for a Llama-3.1-8B shape on an H200, where the whole model took 27 s per shape class
  (bench/graph_compile.py). Inside the CUDA graphs it replays, a decode step then takes 6.2 ms instead of 7.6 plain
  (5.9 whole). Two things would otherwise compile every layer for itself, both because of the layer's int
  `layer_idx`: dynamo treats int attributes of modules as constants (`allow_unspec_int_on_nn_module` makes them
  inputs), and the KV cache's `update` indexes a Python list with it, so it runs uncompiled (its two index writes are
  two kernels either way): a graph break between the projections and the attention, which costs nothing inside a
  graph replay.
- CPU: the whole model, for decode steps only (prompt forwards run it eagerly: ModelRunner._eager_prompts says why).
  Outside CUDA graphs every compiled frame evaluates its guards at each call, and the graph breaks would stop
  inductor from fusing across them: the demo model's int4 decode ran at 44 tok/s with the layers compiled, 76 with
  the whole model, 58 uncompiled (2 cores, through HTTP). Its guards skip the model's modules
  (`skip_guard_on_all_nn_modules_unsafe`: nothing changes a module once loaded; the inputs' shapes are still
  guarded): in the demo model's decode step (2 cores, Xeon with AMX), dynamo's guard checks then took 0.39 instead
  of 1.04 ms (profiled), and the step 10.6 / 10.7 / 11.1 ms against 11.2 / 13.0 / 11.0 (medians of 50 steps, runs in
  turn).
"""

import torch

from rbee_worker.engine.kv_cache import SlotCache


def compile_model(model: torch.nn.Module, cache: SlotCache) -> None:
    """Compile `model` in place (each part on its first call); `cache` must be the one its forwards get."""
    if model.device.type != "cuda":
        # The model's float attributes (RMSNorm eps, attention scaling) as constants: with dynamic shapes dynamo made
        # them symbolic, inductor's pass that turns such floats into tensors gave up on them, and dynamo traced the
        # whole model again for each of the two compilations. Demo model, 2 cores, inductor's cache warm: ready in
        # 22-24 s instead of 58-72 s, decode no slower. (Set here, on the engine thread: dynamo's config is per
        # thread.)
        torch._dynamo.config.specialize_float = True
        model.compile(dynamic=True, options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        return
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    # A layer's frames compile once per class of shapes (one row or several, one token or several, sizes multiples of
    # 8 or not, ...): 9 classes for the attention frame of an 8B model already passed the default limit of 8, after
    # which dynamo runs a frame uncompiled for any class it has not seen.
    torch._dynamo.config.recompile_limit = 64
    cache.update = torch.compiler.disable(cache.update)
    for layer in model.get_decoder().layers:
        layer.compile(dynamic=True)


def uncompile_model(model: torch.nn.Module, cache: SlotCache) -> None:
    """Undo compile_model (after a compilation failed: the plain model runs instead)."""
    torch._dynamo.reset()
    for module in (model, *model.get_decoder().layers):
        module._compiled_call_impl = None
    cache.__dict__.pop("update", None)


def is_compiled(model: torch.nn.Module) -> bool:
    return any(m._compiled_call_impl is not None for m in (model, *model.get_decoder().layers))
