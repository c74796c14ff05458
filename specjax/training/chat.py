"""Conversation data for head training: jsonl conversations rendered with the target's chat template, with a loss
mask that covers exactly the assistant's tokens (the rest is context the heads see but are not trained to draft).

A line holds `{"messages": [{"role", "content"}, ...]}` or ShareGPT's `{"conversations": [{"from", "value"},
...]}` (`human`/`gpt` and the other usual speaker names are mapped to user/assistant). The assistant's tokens are
found by rendering the conversation prefix by prefix: turn i spans from the end of the text of the turns before
it plus the assistant header (`add_generation_prompt`) to the end of the text of the turns up to it (its
end-of-turn tokens included), and a token counts as the assistant's if its characters overlap that span.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from specjax.errors import ChatDataError

ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}


def is_conversation_file(path: str | Path) -> bool:
    """Whether `path` is a jsonl file whose first record is a conversation (`messages` or `conversations`)."""
    path = Path(path)
    if path.suffix != ".jsonl":
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:
                    return False
                return isinstance(record, dict) and ("messages" in record or "conversations" in record)
    return False


def _message(turn, where: str) -> dict:
    if not isinstance(turn, dict):
        raise ChatDataError(
            f"{where}: a turn is {type(turn).__name__}, not an object with a role and content"
        )
    role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    if str(role).lower() not in ROLES or not isinstance(content, str):
        raise ChatDataError(
            f"{where}: a turn needs a role (one of {sorted(ROLES)}) and a text content, got role {role!r} and "
            f"content of type {type(content).__name__}; fix that line"
        )
    return {"role": ROLES[str(role).lower()], "content": content}


def read_conversations(path: str | Path) -> list[list[dict]]:
    """The conversations of a jsonl file as lists of {"role": system|user|assistant, "content"}."""
    path = Path(path)
    conversations = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            record = json.loads(line)
            turns = record["messages"] if "messages" in record else record["conversations"]
        except (ValueError, KeyError, TypeError) as err:
            raise ChatDataError(
                f"{where}: expected a JSON object with 'messages' or 'conversations' ({err}); fix that line"
            ) from err
        if not isinstance(turns, list):
            raise ChatDataError(f"{where}: the conversation is {type(turns).__name__}, not a list of turns")
        messages = [_message(t, where) for t in turns]
        if not any(m["role"] == "assistant" for m in messages):
            raise ChatDataError(
                f"{where}: the conversation has no assistant turn to train on; drop that line"
            )
        conversations.append(messages)
    if not conversations:
        raise ChatDataError(f"{path} holds no conversation (every line is blank); add conversations to it")
    return conversations


def chat_template(tokenizer, template_file: str = "") -> str:
    """The Jinja chat template: the file `template_file` if given, else the tokenizer's own."""
    if not hasattr(tokenizer, "render_chat"):
        raise ChatDataError(
            f"conversation data needs a Hugging Face tokenizer (tokenizer.json), and the target's is a "
            f"{type(tokenizer).__name__}; give the target as a Hugging Face directory"
        )
    if template_file:
        path = Path(template_file)
        if not path.is_file():
            raise ChatDataError(
                f"chat template {path} does not exist; set data.chat_template to a Jinja file"
            )
        return path.read_text(encoding="utf-8")
    if not tokenizer.chat_template:
        raise ChatDataError(
            "the target's tokenizer has no chat template; set data.chat_template to a Jinja template file"
        )
    return tokenizer.chat_template


def template_digest(template: str) -> str:
    return hashlib.sha256(template.encode()).hexdigest()


def prompt_ids(tokenizer, messages: list[dict], template: str) -> list[int]:
    """Token ids (BOS first) of `messages` followed by the header of the assistant's next turn: what the target
    is given to write that turn."""
    text = tokenizer.render_chat(messages, template, add_generation_prompt=True)
    ids = tokenizer.encode_with_offsets(text)[0]
    return ids if ids[:1] == [tokenizer.bos_id] else [tokenizer.bos_id] + ids


def tokenize(tokenizer, messages: list[dict], template: str) -> tuple[list[int], np.ndarray]:
    """Token ids of the rendered conversation (BOS first) and its loss mask: 1 on the assistant's tokens (their
    end-of-turn tokens included), 0 elsewhere."""
    full = tokenizer.render_chat(messages, template)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tokenizer.render_chat(messages[:i], template, add_generation_prompt=True)
        end_text = tokenizer.render_chat(messages[: i + 1], template)
        if not (full.startswith(end_text) and end_text.startswith(prompt)):
            raise ChatDataError(
                "the chat template renders a conversation's turns differently when later turns follow, so the "
                "assistant's tokens cannot be located; use a template that renders conversations prefix by prefix"
            )
        spans.append((len(prompt), len(end_text)))
    ids, offsets = tokenizer.encode_with_offsets(full)
    mask = np.zeros(len(ids), np.int8)
    for k, (a, b) in enumerate(offsets):
        mask[k] = any(a < end and b > start for start, end in spans)
    if ids[:1] != [tokenizer.bos_id]:
        ids, mask = [tokenizer.bos_id] + ids, np.concatenate([[0], mask]).astype(np.int8)
    return ids, mask
