"""Chat prompts: messages through the model's own chat template, as the instruct model was trained.

An instruct model given raw text continues it as text; given the same words as a user turn rendered
with its chat template, it answers. The template ships with the tokenizer (copied into the engine
dir by medusa-build), so the engine's tokenizer renders it. Used by medusa-run (--chat, the default
where a template exists), the Triton model's `messages` input and the Python API:

    tok = load_tokenizer("engine/")
    ids = encode_chat(tok, [{"role": "user", "content": "Hi!"}])
"""

from __future__ import annotations

import json

from medusa_trt.errors import MedusaTrtError

ROLES = ("system", "user", "assistant")


class ChatError(MedusaTrtError):
    """Messages that cannot be rendered (a malformed list, a model without a chat template)."""


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def is_rendered(tokenizer, text: str) -> bool:
    """Text that already holds the tokenizer's special tokens (a prompt rendered with its template,
    such as '<|im_start|>user...'): sent as it is, never wrapped in a second turn."""
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    specials.update(t.content for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()
                    if getattr(t, "special", False))
    return any(s and s in text for s in specials)


def messages_for(text: str, system: str | None = None) -> list[dict[str, str]]:
    """One user turn, after a system turn when `system` is given."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def parse_messages(value: object, where: str = "messages") -> list[dict[str, str]]:
    """A messages list (or its JSON text): [{"role": "system"|"user"|"assistant", "content": str}, ...]."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ChatError(f"{where}: not JSON ({e}); expected a list such as "
                            '[{"role": "user", "content": "Hi"}]') from None
        except RecursionError:  # nested past the parser's stack; real chat turns are two levels deep
            raise ChatError(f"{where}: JSON nested too deep; expected a list such as "
                            '[{"role": "user", "content": "Hi"}]') from None
    if not isinstance(value, list) or not value:
        raise ChatError(f"{where}: expected a non-empty list of {{\"role\": ..., \"content\": ...}} objects")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise ChatError(f"{where}[{i}]: {str(m)[:60]}; expected {{\"role\": one of {', '.join(ROLES)}, "
                            "\"content\": a string}")
    return value


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids of `messages` rendered with the tokenizer's chat template, ending with the
    assistant's turn opened (add_generation_prompt), so the model answers."""
    messages = parse_messages(messages)
    if not has_chat_template(tokenizer):
        raise ChatError("this model's tokenizer has no chat template; send the prompt as raw text")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))  # the template holds any BOS itself
