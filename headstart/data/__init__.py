"""Conversation data: sources, chat-template rendering, exact assistant-only loss masks, splits."""

from headstart.data.sources import SourceRead, read_conversations, read_prompts
from headstart.data.template import ChatRenderer, Rendered, TemplateMismatch, mark_supervised

__all__ = [
    "ChatRenderer",
    "Rendered",
    "SourceRead",
    "TemplateMismatch",
    "mark_supervised",
    "read_conversations",
    "read_prompts",
]
