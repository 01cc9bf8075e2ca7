"""What a model's chat template adds to a prompt, in tokens (issue 49): a trace counts its prompts as
the engine saw them, template included, so a replay's texts are that much shorter.

The template is the model's own (``chat_template.jinja``, else ``tokenizer_config.json``'s
``chat_template``), rendered as engines render it (Jinja2, sandboxed, ``trim_blocks`` and
``lstrip_blocks``, ``raise_exception`` defined) with its ``bos_token`` and ``eos_token``. The cost is
measured by rendering a conversation and counting tokens with and without its contents: a merge at a
boundary between a message and the template's markup can move it by a token, which the replay's
fidelity (the engine's prompt tokens against the trace) shows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from k3pipe.core.errors import BenchmarkError

__all__ = ["TemplateCost", "load_chat_template", "render_chat", "template_cost"]

# contents whose tokens do not merge with markup around them in the tokenizers seen (words, spaces)
_FIRST, _ANSWER, _NEXT = "first message here", "an answer here", "next message here"


@dataclass(frozen=True)
class TemplateCost:
    """Tokens a chat template adds: ``first`` around a conversation's one user message (with the
    generation prompt), ``turn`` for each later turn (the previous answer's and the new message's
    markup, with the generation prompt again); ``template`` says where it came from."""

    first: int
    turn: int
    template: str


def load_chat_template(model_dir: Path) -> tuple[str, dict[str, str]] | None:
    """The model's chat template and its special tokens, or None when it has none."""
    config: dict[str, Any] = {}
    config_path = model_dir / "tokenizer_config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise BenchmarkError(f"{config_path} cannot be read as JSON ({exc}): fix or remove it") from None
    source = model_dir / "chat_template.jinja"
    template: str | None = source.read_text(encoding="utf-8") if source.is_file() else None
    if template is None:
        raw = config.get("chat_template")
        if isinstance(raw, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
            raw = named.get("default") or next(iter(named.values()), None)
        template = raw if isinstance(raw, str) else None
    if template is None:
        return None
    specials = {}
    for key in ("bos_token", "eos_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        specials[key] = value if isinstance(value, str) else ""
    return template, specials


def render_chat(template: str, specials: dict[str, str], messages: list[dict[str, Any]]) -> str:
    """A conversation rendered with the model's chat template as the engines render it (the
    generation prompt added)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True, **specials)
    except TemplateError as exc:
        raise BenchmarkError(f"the model's chat template cannot render a conversation: {exc}") from None


def template_cost(model_dir: Path, tokenizer: Tokenizer) -> TemplateCost:
    """The tokens the model's chat template adds (zero for a model without one: its prompts go as they
    are, as the completions API sends them)."""
    loaded = load_chat_template(model_dir)
    if loaded is None:
        return TemplateCost(0, 0, "none")
    template, specials = loaded

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    one = [{"role": "user", "content": _FIRST}]
    three = [*one, {"role": "assistant", "content": _ANSWER}, {"role": "user", "content": _NEXT}]
    first_text = render_chat(template, specials, one)
    rendered_one = count(first_text)
    first = rendered_one - count(_FIRST)
    turn = count(render_chat(template, specials, three)) - rendered_one - count(_ANSWER) - count(_NEXT)
    return TemplateCost(
        max(0, first),
        max(0, turn),
        "chat_template.jinja" if (model_dir / "chat_template.jinja").is_file() else "tokenizer_config.json",
    )
