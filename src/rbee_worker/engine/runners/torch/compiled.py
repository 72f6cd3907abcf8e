"""--compile: the model's forward through torch.compile, in place (`nn.Module.compile`), with dynamic shapes (one
compilation covers every batch size above one and every attention span; `ModelRunner.warm_up` runs each class of
forward once before ready). What is compiled depends on the device, each choice the faster one there
(bench/results/README.md):

- CUDA: each decoder layer (PyTorch's "regional compilation"). The layers share one class and one forward, and with
  parameters as graph inputs (dynamo's default) they share one compiled code, so compiling takes about as long as
  one layer, a fraction of what compiling the whole model takes per shape class (bench/graph_compile.py); inside
  the CUDA graphs it replays, the compiled decode step is faster than the plain one and close to the whole model
  compiled. Two things would otherwise compile every layer for itself, both because of the layer's int
  `layer_idx`: dynamo treats int attributes of modules as constants (`allow_unspec_int_on_nn_module` makes them
  inputs), and the KV cache's `update` indexes a Python list with it, so it runs uncompiled (its write is a kernel of
  its own either way, kernels/kv_write.py): a graph break between the projections and the attention, which costs
  nothing inside a graph replay. The model's final norm and its rotary embedding are compiled too, each a frame of
  its own: run eagerly they are about thirty small kernels a step.
- CPU: the whole model, for decode steps only (prompt forwards run it eagerly: ModelRunner._eager_prompts says why).
  Outside CUDA graphs every compiled frame evaluates its guards at each call, and the graph breaks would stop
  inductor from fusing across them: with the layers compiled one by one the demo model's int4 decode is slower
  than uncompiled, with the whole model compiled faster. Its guards skip the model's modules
  (`skip_guard_on_all_nn_modules_unsafe`: nothing changes a module once loaded; the inputs' shapes are still
  guarded), which makes dynamo's guard checks on each decode step cheaper and the step no slower.
"""

import torch

from rbee_worker.engine.runners.torch.kv_cache import PagedCache


def compile_model(model: torch.nn.Module, cache: PagedCache) -> None:
    """Compile `model` in place (each part on its first call); `cache` must be the one its forwards get."""
    if model.device.type != "cuda":
        # The model's float attributes (RMSNorm eps, attention scaling) as constants: with dynamic shapes dynamo makes
        # them symbolic, inductor's pass that turns such floats into tensors gives up on them, and dynamo traces the
        # whole model again for each of the two compilations; as constants the worker is ready sooner and decodes
        # no slower (bench/results/README.md). (Set here, on the engine thread: dynamo's config is per thread.)
        torch._dynamo.config.specialize_float = True
        model.compile(dynamic=True, options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        return
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    # A layer's frames compile once per class of shapes (one row or several, one token or several, sizes multiples of
    # 8 or not, ...): 9 classes for the attention frame of an 8B model already passed the default limit of 8, after
    # which dynamo runs a frame uncompiled for any class it has not seen.
    torch._dynamo.config.recompile_limit = 64
    cache.update = torch.compiler.disable(cache.update)
    for module in _regions(model):
        module.compile(dynamic=True)


def _regions(model: torch.nn.Module) -> list[torch.nn.Module]:
    """What is compiled on CUDA: each decoder layer, the final norm and the rotary embedding (those the model has)."""
    decoder = model.get_decoder()
    extra = [getattr(decoder, name, None) for name in ("norm", "rotary_emb")]
    return [*decoder.layers, *(module for module in extra if isinstance(module, torch.nn.Module))]


def uncompile_model(model: torch.nn.Module, cache: PagedCache) -> None:
    """Undo compile_model (after a compilation failed: the plain model runs instead)."""
    torch._dynamo.reset()
    for module in (model, *_regions(model)):
        module._compiled_call_impl = None
    cache.__dict__.pop("update", None)
