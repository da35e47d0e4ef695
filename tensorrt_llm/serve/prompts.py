"""A request's prompt as the token ids the executor runs: what :class:`OpenAIServer` queues, and
what a router in front of several servers hashes to find the replica that has them cached
(``serve.ray_serve``). One code path, so both see the same ids."""

from __future__ import annotations

import asyncio

from tensorrt_llm.llmapi.tokenizer import Tokenizer
from tensorrt_llm.serve.errors import bad_request
from tensorrt_llm.serve.openai_protocol import ChatCompletionRequest
from tensorrt_llm.serve.tool_calling import ToolPlan, template_messages


class PromptRenderer:
    """Prompts to token ids with the model's tokenizer (None: token ids only) and chat template
    (the server's ``--chat_template``, else the model's). Each method raises the 400
    (``OpenAIError``) that names the field a prompt cannot be taken from."""

    def __init__(self, model_id: str, tokenizer: Tokenizer | None, chat_template: str | None) -> None:
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    async def encode(self, prompt: str | list[int], param: str = "prompt", *,
                     add_special_tokens: bool = True) -> list[int]:
        """A completions prompt: token ids as given, text through the tokenizer (on a worker thread)."""
        if isinstance(prompt, list):
            if not prompt:
                raise bad_request("the prompt is empty", param)
            return prompt  # range-checked against the vocabulary by the executor's validation
        if self.tokenizer is None:
            raise bad_request(f"model {self.model_id!r} has no tokenizer: send the prompt as a list of token ids",
                              param)
        if not prompt:
            raise bad_request("the prompt is empty", param)
        try:
            # long texts take a while: off the event loop
            token_ids = await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens)
        except ValueError as error:  # text the tokenizer cannot take (the edge refuses what it knows of)
            raise bad_request(f"{param}: {error}", param) from None
        if not token_ids:
            raise bad_request("the prompt encodes to no tokens", param)
        return token_ids

    async def render_chat(self, body: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
        """The conversation through the chat template, tools included, as token ids."""
        if self.tokenizer is None or not self.chat_template:
            raise bad_request(f"model {self.model_id!r} has no chat template: use /v1/completions"
                              + (" with token ids" if self.tokenizer is None else ""), "messages")
        messages = template_messages(body.messages)
        tools = {} if plan.template_tools is None else {"tools": plan.template_tools}
        try:
            text = await asyncio.to_thread(self.tokenizer.apply_chat_template, messages, add_generation_prompt=True,
                                           chat_template=self.chat_template, **tools, **(body.chat_template_kwargs or {}))
        except ValueError as error:  # a conversation the template refuses (e.g. roles out of order)
            raise bad_request(str(error), "messages") from None
        # The template writes the special tokens it wants (a BOS included): encode none on top.
        return await self.encode(text, "messages", add_special_tokens=False)


def read_chat_template(path: str) -> str:
    """A ``--chat_template`` file's text; ValueError naming the file when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except OSError as error:
        raise ValueError(f"chat_template {path}: cannot read it: {error.strerror or error}") from None
