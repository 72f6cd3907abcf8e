"""What a loader hands to the engine: the model, its tokenizer, and measured facts about it."""

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from rbee_worker.chat.tool_prompt import TemplateCaps, probe_caps, template_messages
from rbee_worker.chat.tools import ToolFormat, tool_format
from rbee_worker.hardware.devices import tensor_bytes
from rbee_worker.loading.pooling import Pooling, pooling_of
from rbee_worker.loading.prompt_bound import PromptBound, prompt_bound

if TYPE_CHECKING:  # imports llama-cpp-python, an optional dependency
    from rbee_worker.loading.gguf.llama_cpp_model import LlamaCppModel


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the model's own name: default model_ref, shown in /health and events
    path: Path
    format: str  # "hf" or "gguf"
    architecture: str  # transformers model_type, e.g. "llama"
    context_length: int
    eos_token_ids: frozenset[int]
    device: torch.device
    dtype: torch.dtype
    weight_bytes: int  # measured from the loaded tensors (llama.cpp: its own figure), not the file size
    load_seconds: float = 0.0
    runtime: str = "torch"  # what runs the forward: "torch" (model: a transformers model) or "llama.cpp"
    unrouted_bytes: int = 0  # of a mixture of experts: the expert weights that one token's forward does not read
    encoder: bool = False  # an encoder (BERT family: attention both ways, no LM head): it embeds and generates nothing

    @property
    def active_weight_bytes(self) -> int:
        """The weights one token's forward reads: all but the experts it is not routed to (a dense model's all)."""
        return self.weight_bytes - self.unrouted_bytes


@dataclass(frozen=True)
class LoadedModel:
    model: "PreTrainedModel | LlamaCppModel"  # which one: info.runtime
    tokenizer: PreTrainedTokenizerFast
    info: ModelInfo

    def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """Token ids of a raw prompt, exactly as the model's tokenizer makes them (BOS as its settings say)."""
        return tuple(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text the model's chat template renders (transformers' apply_chat_template), by default ending
        with the assistant turn's header; tools, calls and tool results it cannot render itself are rewritten
        (chat/tool_prompt.py); `template_kwargs` are variables for the template (enable_thinking, say). Raises
        ValueError when the model has no template, or a template error."""
        if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages, tools = template_messages(messages, tools, self.template_caps)
        return self._render(messages, tools, add_generation_prompt, **(template_kwargs or {}))

    def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[int, ...]:
        # The template writes BOS and the other special tokens itself, so none are added again.
        prompt = self.chat_prompt(messages, add_generation_prompt, tools, template_kwargs)
        return self.tokenize(prompt, add_special_tokens=False)

    @functools.cached_property
    def pooling(self) -> Pooling:
        """How the model's hidden states make an embedding (loading/pooling.py)."""
        return pooling_of(self.info.path, self.info.encoder)

    @functools.cached_property
    def prompt_bound(self) -> PromptBound | None:
        """How much text one token can stand for at most (loading/prompt_bound.py); None: no bound."""
        return prompt_bound(self.tokenizer)

    @functools.cached_property
    def template_caps(self) -> TemplateCaps:
        """What the chat template renders of tools, calls and tool results itself (probed once)."""
        return probe_caps(lambda messages, tools: self._render(messages, tools, False))

    @functools.cached_property
    def tool_format(self) -> ToolFormat:
        """The format the model writes tool calls in (Hermes where its template teaches none)."""
        template = self.tokenizer.chat_template
        return tool_format(template if isinstance(template, str) else None)

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        **template_kwargs: Any,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
        )


def context_length_of(config) -> int:
    """The longest sequence the model was built for, under the names different architectures use."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        if isinstance(value := getattr(config, key, None), int) and value > 0:
            return value
    return 2048


def eos_ids(*sources: int | list[int] | None) -> frozenset[int]:
    """Union of every EOS id that config, generation_config and tokenizer declare."""
    ids: set[int] = set()
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return frozenset(ids)


# Experts modules that multiply every token by every expert (weighted by the router's scores, 0 where it does not
# route): transformers' Llama 4 text MoE, which does not go through its experts interface.
DENSE_EXPERTS = frozenset({"Llama4TextExperts"})


def unrouted_bytes(model: torch.nn.Module, routed: int | None) -> int:
    """The bytes of expert weights that one token does not read when `routed` experts of each layer serve it: each
    experts module's weights stacked by expert ([experts, out, in], and its biases [experts, out] beside them; not a
    router's [experts, in]) times the share of experts not routed to. 0 for a dense model, and for experts modules
    that compute every expert for every token (DENSE_EXPERTS)."""
    unread = 0.0
    for module in model.modules():
        experts = getattr(module, "num_experts", None)
        if not isinstance(experts, int) or not routed or routed >= experts or type(module).__name__ in DENSE_EXPERTS:
            continue
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]  # quantized ones: buffers
        own = [t for t in tensors if t.shape[:1] == (experts,)]
        if any(p.dim() == 3 for p in own):
            unread += sum(p.nbytes for p in own) * (experts - routed) / experts
    return int(unread)


def finish(model: PreTrainedModel, tokenizer, info: dict, device: torch.device) -> LoadedModel:
    """Common last step of both loaders: eval mode, measured size (and the experts a token does not read), ModelInfo."""
    model.eval()
    if model.can_generate() and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    routed = getattr(model.config.get_text_config(), "num_experts_per_tok", None)
    sizes = {"weight_bytes": tensor_bytes(model), "unrouted_bytes": unrouted_bytes(model, routed)}
    return LoadedModel(model, tokenizer, ModelInfo(**info, device=device, **sizes))
