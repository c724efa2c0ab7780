"""Prompts as the API takes them: text, chat messages or token ids, one or a batch; checked and turned into ids."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch

from draftwise.errors import DraftwiseError
from draftwise.models.loading import LoadedModel


PROMPT_FORMS = (
    "a string, token ids (a list of ints, a 1-D tensor or numpy array, or the BatchEncoding that tokenizer(...) "
    "and apply_chat_template(...) return) or chat messages [{'role': 'user', 'content': '...'}]"
)


def _describe(value: Any) -> str:
    """What was passed, in a few words, for error messages."""
    if isinstance(value, Mapping):
        return f"{type(value).__name__} with keys {sorted(map(str, value))[:6]}"
    if isinstance(value, (torch.Tensor,)) or type(value).__module__ == "numpy":
        shape = tuple(getattr(value, "shape", ()))
        return f"{type(value).__name__} of shape {shape} and dtype {getattr(value, 'dtype', '?')}"
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"{type(value).__name__} of {len(value)} {'/'.join(kinds) or 'items'}"
    return type(value).__name__


def _is_messages(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, Mapping) for m in value)


def _is_token_list(value: Any) -> bool:
    if not isinstance(value, (list, tuple)):
        return False
    if all(type(t) is int for t in value):  # the common case, without an abstract-class check per token
        return True
    return all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value)


def _as_array(value: Any) -> Any:
    """input_ids of a BatchEncoding / mapping, else the value itself."""
    if isinstance(value, Mapping) and "input_ids" in value:
        return value["input_ids"]
    return value


def _rows(value: Any) -> list[Any] | None:
    """The prompts of a 2-D batch (tensor, numpy array, BatchEncoding with several rows); None if not one."""
    mask = value.get("attention_mask") if isinstance(value, Mapping) else None
    ids = _as_array(value)
    if isinstance(ids, torch.Tensor) or type(ids).__module__ == "numpy":
        if getattr(ids, "ndim", 0) != 2:
            return None
        rows = [list(map(int, r)) for r in ids.tolist()]
    elif isinstance(ids, (list, tuple)) and ids and all(_is_token_list(r) for r in ids) and isinstance(value, Mapping):
        rows = [list(r) for r in ids]
    else:
        return None
    if mask is not None:  # drop padding, left or right
        mask = mask.tolist() if hasattr(mask, "tolist") else mask
        rows = [[t for t, m in zip(r, mr) if m] for r, mr in zip(rows, mask)]
    return rows


def split_prompts(prompt_or_prompts: Any) -> tuple[list[Any], bool]:
    """(prompts, is_batch). One prompt: a string, token ids (list, 1-D tensor/array, one-row BatchEncoding) or
    one chat (a list of message dicts). A batch: a list of those (strings, id lists, chats), a 2-D tensor or
    array, or a BatchEncoding with several rows. For the batched `generate` / `stream`."""
    value = prompt_or_prompts
    if value is None:
        raise DraftwiseError(f"no prompt: give {PROMPT_FORMS}, or a list of them")
    if isinstance(value, str) or _is_messages(value):
        return [value], False
    rows = _rows(value)
    if rows is not None:  # a [1, n] tensor / BatchEncoding is one prompt, as transformers' generate reads it
        return (rows, True) if len(rows) > 1 else ([value], False)
    ids = _as_array(value)
    if isinstance(ids, (torch.Tensor,)) or type(ids).__module__ == "numpy" or _is_token_list(ids):
        return [value], False
    if isinstance(value, (list, tuple)):
        if not value:
            raise DraftwiseError("the list of prompts is empty")
        if all(isinstance(p, str) or _is_messages(p) or _is_token_list(p) or isinstance(p, (torch.Tensor, Mapping))
               for p in value):
            return list(value), True
    raise DraftwiseError(f"a prompt must be {PROMPT_FORMS}, or a list of them; got {_describe(value)}")


def check_prompt(prompt: Any) -> None:
    """The prompt's form, checked before any model loads (token ranges are checked against the model later)."""
    if prompt is None:
        raise DraftwiseError(f"no prompt: give {PROMPT_FORMS}")
    if isinstance(prompt, str):
        if not prompt:
            raise DraftwiseError("prompt is empty")
        check_text(prompt, "prompt")
        return
    if _is_messages(prompt):
        check_messages(prompt)
        return
    rows = _rows(prompt)
    if rows is not None and len(rows) != 1:
        raise DraftwiseError(f"got a batch of {len(rows)} prompts ({_describe(_as_array(prompt))}) where one prompt "
                             "was expected: pass one row, or a list of prompts to the batched generate")
    ids = _as_array(prompt)
    if isinstance(ids, torch.Tensor) or type(ids).__module__ == "numpy":
        integer = (not ids.dtype.is_floating_point and not ids.dtype.is_complex and ids.dtype != torch.bool
                   if isinstance(ids, torch.Tensor) else getattr(ids.dtype, "kind", "") in ("i", "u"))
        if not integer or not 1 <= ids.ndim <= 2:
            raise DraftwiseError(f"token ids must be integers in a 1-D tensor or array; got {_describe(ids)}")
        return
    if isinstance(ids, (list, tuple)):
        if _is_token_list(ids):
            return
        if all(isinstance(p, (str, list, tuple, Mapping, torch.Tensor)) for p in ids):
            raise DraftwiseError(f"got {_describe(ids)} where one prompt was expected: a list of prompts is a batch "
                                 "(the batched generate takes it); one prompt is " + PROMPT_FORMS)
        raise DraftwiseError(f"token ids must be integers; got {_describe(ids)} (a prompt is {PROMPT_FORMS})")
    raise DraftwiseError(f"a prompt must be {PROMPT_FORMS}; got {_describe(prompt)}")


def check_messages(messages: Any) -> None:
    if not _is_messages(messages):
        raise DraftwiseError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts; got "
                             + _describe(messages))
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or "content" not in m:
            raise DraftwiseError(f"message {i} needs a 'role' string and a 'content'; got keys {sorted(m)}")
        content = m["content"]
        if not isinstance(content, str) and not (isinstance(content, list) and all(
                isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
                for part in content)):
            raise DraftwiseError(f"message {i}: content must be a string or a list of {{'type': 'text', 'text': ...}} "
                                 f"parts; got {_describe(content)}")
        for text in [content] if isinstance(content, str) else [part["text"] for part in content]:
            check_text(text, f"message {i}")


def check_text(text: str, what: str) -> None:
    """A one-line error for text that is not valid Unicode: a lone surrogate, or (from a command line read with
    Python's surrogateescape) a byte that was not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        char = text[error.start]
        if "\udc80" <= char <= "\udcff":
            raise DraftwiseError(f"{what} is not valid UTF-8: byte 0x{ord(char) - 0xDC00:02x} at character "
                                 f"{error.start}") from None
        raise DraftwiseError(f"{what} holds {char!a} at character {error.start}, which is not valid Unicode text "
                             "(a lone surrogate)") from None


def messages_to_ids(messages: Any, tokenizer: Any) -> list[int]:
    """OpenAI-style chat messages -> the prompt's token ids through the tokenizer's chat template, with the
    assistant's turn opened (or, when the last message is the assistant's, continued)."""
    check_messages(messages)
    if tokenizer is None:
        raise DraftwiseError("chat messages need a tokenizer; load the target with tokenizer=...")
    if not getattr(tokenizer, "chat_template", None):
        raise DraftwiseError("the target's tokenizer has no chat template: give the prompt as a string instead")
    normal = [{**m, "content": m["content"] if isinstance(m["content"], str)
               else "".join(part.get("text", "") for part in m["content"])} for m in messages]
    continue_last = normal[-1]["role"] == "assistant"
    try:
        encoded = tokenizer.apply_chat_template(normal, tokenize=True, add_generation_prompt=not continue_last,
                                                continue_final_message=continue_last)
    except Exception as error:  # noqa: BLE001 - a template refusing the messages (e.g. no system role) is bad input
        raise DraftwiseError(f"the chat template refused these messages: {str(error).splitlines()[0]}") from None
    ids = _as_array(encoded)
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return ids


def encode_prompt(prompt: Any, target: LoadedModel, vocab_size: int) -> list[int]:
    check_prompt(prompt)
    if isinstance(prompt, str):
        if target.tokenizer is None:
            raise DraftwiseError("a text prompt needs a tokenizer; pass token ids or load the target with tokenizer=...")
        ids = target.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    elif _is_messages(prompt):
        ids = messages_to_ids(prompt, target.tokenizer)
    else:
        rows = _rows(prompt)
        if rows is not None:
            ids = rows[0]
        else:
            raw = _as_array(prompt)
            raw = raw.tolist() if hasattr(raw, "tolist") else list(raw)
            ids = raw[0] if raw and isinstance(raw[0], list) else raw
        ids = [int(t) for t in ids]
    if not ids:
        raise DraftwiseError("prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise DraftwiseError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
    return ids
