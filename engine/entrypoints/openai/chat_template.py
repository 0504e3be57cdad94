"""``render_chat``: a chat request's conversation through the tokenizer's chat template, as every server renders it.

A free function of the tokenizer, so a caller without an engine (the Ray ingress tokenizing to route,
``deployments.routing_hints``) renders exactly as the chat and tokenize servings do.
"""

from __future__ import annotations

from typing import Any

from engine.entrypoints.openai.protocol import ChatTemplateFields

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
    """The conversation (and its tools, when the request has any) rendered by ``tokenizer``'s chat template,
    and its token ids. ValueError when the template fails on these messages."""
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
            **template_kwargs,
        )
    except Exception as exc:  # noqa: BLE001 - a template failing on this input (jinja raises its own types)
        raise ValueError(f"The chat template failed on these messages: {exc}") from exc
    return text, tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
