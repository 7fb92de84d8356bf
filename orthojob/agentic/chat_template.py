"""A chat template TRL accepts for tool calling, for tokenizers whose own cannot render tool calls."""

from __future__ import annotations


def prepare_tokenizer(tokenizer):
    """The tokenizer, with a chat template TRL accepts for tool calling where its own does not.

    A template that cannot render tool calls (the tiny model's ChatML, :mod:`orthojob.modeling.tiny_model`) is
    replaced by TRL's Qwen2.5 template: the same ChatML turns for system/user/assistant messages plus
    the ``<tool_call>`` JSON tags and a tools section in the system message, for which TRL sets the
    response parser (``add_response_schema``). A template that already supports tools is kept.
    """
    from trl.chat_template_utils import qwen2_5_chat_template, supports_tool_calling

    if not supports_tool_calling(tokenizer):
        tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer
