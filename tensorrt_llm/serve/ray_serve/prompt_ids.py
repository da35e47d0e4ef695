"""Where a request is tokenized for routing: in the ingress, by the replicas' own code.

The router needs a request's prompt as the token ids the replica will queue, before any replica
has seen it. The ingress renders them with a :class:`PromptRenderer` built from the model's
metadata (tokenizer and chat template, no weights: :func:`prompt_renderer`) and the same
``ServerConfig`` (``chat_template``, ``tool_parser``) as the replicas' ``OpenAIServer``, through
the same methods (``encode`` for completions, ``render_chat`` with the tool plan for chat): equal
inputs, equal ids. The replica renders the request again when it serves it (it is the authority:
a request the ingress cannot render is routed without ids, and the replica answers the error).
Nothing here imports Ray.
"""

from __future__ import annotations

from tensorrt_llm.llmapi.llm_utils import describe_checkpoint, seeded_model
from tensorrt_llm.serve.errors import OpenAIError
from tensorrt_llm.serve.openai_protocol import ChatCompletionRequest, CompletionRequest
from tensorrt_llm.serve.prompts import PromptRenderer, read_chat_template
from tensorrt_llm.serve.server_config import ServerConfig
from tensorrt_llm.serve.tool_calling import plan_tools
from tensorrt_llm.serve.tool_parsers import get_tool_parser

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def prompt_renderer(model: str, server: ServerConfig, dtype: str | None = None) -> PromptRenderer:
    """The prompt renderer of the replicas' ``OpenAIServer`` for ``model`` (as ``LLM(model)``
    names it), from its metadata only."""
    seeded = seeded_model(model)
    if seeded is not None:
        return PromptRenderer(seeded[0], None, None)
    checkpoint = describe_checkpoint(model, dtype=dtype)
    tokenizer = checkpoint.tokenizer
    template = read_chat_template(server.chat_template) if server.chat_template else (
        tokenizer.chat_template if tokenizer is not None else None)
    return PromptRenderer(checkpoint.model_id, tokenizer, template)


class RoutingPrompts:
    """A request body's prompt ids for the router (see the module docstring)."""

    def __init__(self, renderer: PromptRenderer, server: ServerConfig) -> None:
        self.renderer = renderer
        self.tool_parser = get_tool_parser(server.tool_parser) if server.tool_parser else None

    async def prompt_ids(self, path: str, body: bytes) -> list[int] | None:
        """The prompt ids of a completions or chat request (a batch of prompts: the first); None
        for any other request, or one that cannot be rendered."""
        try:
            if path == COMPLETIONS:
                return await self.renderer.encode(CompletionRequest.model_validate_json(body).prompts[0])
            if path == CHAT:
                chat = ChatCompletionRequest.model_validate_json(body)
                plan = plan_tools(chat, self.tool_parser, self.renderer.chat_template)
                return await self.renderer.render_chat(chat, plan)
        except (ValueError, OpenAIError):  # pydantic's ValidationError is a ValueError
            return None
        return None
