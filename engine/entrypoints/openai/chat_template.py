"""``render_chat``: a chat request's conversation through the chat template, as every server renders it.

The template is the request's own ``chat_template`` (vLLM's field), else the tokenizer's (which
``ModelConfig.chat_template``, vLLM's ``--chat-template``, replaces); a model with neither (a base model, such as
Gemma 3 270M's file) refuses the request, as vLLM does, saying what works instead.

A free function of the tokenizer, so a caller without an engine (the Ray ingress tokenizing to route,
``deployments.routing_hints``) renders exactly as the chat and tokenize servings do.
"""

from __future__ import annotations

from typing import Any

from engine.entrypoints.openai.protocol import ChatTemplateFields

NO_CHAT_TEMPLATE = (
    "This model has no chat template; use /v1/completions, or pass chat_template (in the request, or the "
    "server's --chat-template)."
)

# Keyword arguments of apply_chat_template the serving sets itself; a request's chat_template_kwargs can't.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tools",
        "documents",
    }
)


def render_chat(tokenizer: Any, request: ChatTemplateFields) -> tuple[str, list[int]]:
    """The conversation (and its tools, when the request has any) rendered by the chat template (the module
    docstring's), and its token ids. ValueError when there is no template, or it fails on these messages."""
    chat_template = request.chat_template or tokenizer.chat_template
    if not chat_template:
        raise ValueError(NO_CHAT_TEMPLATE)
    template_kwargs = {
        key: value
        for key, value in (request.chat_template_kwargs or {}).items()
        if key not in _RESERVED_TEMPLATE_KWARGS
    }
    tools = request.tool_dicts()
    try:
        text = tokenizer.apply_chat_template(
            request.conversation(),
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            tools=tools,
            chat_template=chat_template,
            **template_kwargs,
        )
    except Exception as exc:  # noqa: BLE001 - a template failing on this input (jinja raises its own types)
        raise ValueError(f"The chat template failed on these messages: {exc}") from exc
    return text, tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
