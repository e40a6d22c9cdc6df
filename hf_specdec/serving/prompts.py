"""A request's prompts as token ids: the chat API's messages through the tokenizer's chat template, the completions
API's prompt in each form it takes."""

from __future__ import annotations

import inspect

from .stream import RequestError

# Chat roles a template understands; `developer` (OpenAI's newer name for system instructions) is sent as `system`.
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_prompt(messages, tokenizer, add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict | None = None) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...} objects", "messages")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a 'role' string", "messages")
        if message["role"] not in _ROLES:
            raise RequestError(f"messages[{i}].role {message['role']!r} is not supported; use one of "
                               f"{sorted(_ROLES)}", "messages")
        extra = sorted(k for k, v in message.items() if k not in ("role", "content") and v not in (None, [], ""))
        if extra:  # a name, tool calls, ...: the template would drop them without a word
            raise RequestError(f"messages[{i}].{extra[0]} is not supported by this server; drop it", "messages")
        content = message.get("content")
        if content is None and message["role"] == "assistant":  # an assistant turn with nothing said (vLLM: empty)
            content = ""
        if isinstance(content, list):  # content parts: only text
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported", "messages")
            content = "\n".join(p["text"] for p in content)  # as vLLM joins them
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts", "messages")
        plain.append({"role": _ROLES[message["role"]], "content": content})
    if continue_final_message and plain[-1]["role"] != "assistant":
        raise RequestError("continue_final_message needs the last message to be the assistant's",
                           "continue_final_message")
    # Only the template's own variables: none of apply_chat_template's parameters (a template of the client's, tools
    # the server refuses, tensors back, ...)
    reserved = {name for name, parameter in inspect.signature(tokenizer.apply_chat_template).parameters.items()
                if parameter.kind is not parameter.VAR_KEYWORD} | {"messages", "conversation"}
    if template_kwargs and reserved & set(template_kwargs):
        raise RequestError(f"chat_template_kwargs cannot set {sorted(reserved & set(template_kwargs))}",
                           "chat_template_kwargs")
    try:
        ids = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message, tokenize=True,
                                            **(template_kwargs or {}))
    except Exception as bad:  # noqa: BLE001 - the template's own complaint (say, roles out of order)
        raise RequestError(f"messages: the chat template refused them ({bad})", "messages") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def completion_prompts(prompt, tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer(prompt)["input_ids"]]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [tokenizer(p)["input_ids"] for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise RequestError("prompt must be a non-empty string, a list of strings, a list of token ids or a list of such "
                       "lists", "prompt")
