"""The prompt at the edge: text checked (UTF-8, not empty), chat-formatted, encoded, and the number of new
tokens bounded by the context, so that a user learns what happened instead of meeting a traceback.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, BinaryIO

from hetero.errors import ConfigError

log = logging.getLogger(__name__)


def check_text(text: str, what: str = "prompt") -> str:
    """`text` if it is non-empty valid UTF-8; command-line bytes that are not UTF-8 reach Python as lone
    surrogates (PEP 383), which no tokenizer can encode: ConfigError naming the byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) - 0xDC00 if 0xDC80 <= ord(text[e.start]) <= 0xDCFF else ord(text[e.start])
        raise ConfigError(f"{what} is not valid UTF-8 (byte 0x{byte:02x} at character {e.start}): pass UTF-8 "
                          f"text (check the terminal's locale)") from None
    if not text.strip():
        raise ConfigError(f"{what} is empty: give the text to answer, e.g. hetero run \"What is the capital of France?\"")
    return text


def _utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def read_prompt(arg: str | None, file: str | None = None, stdin: BinaryIO | None = None) -> str:
    """The prompt text: the argument itself, standard input when the argument is `-`, or the contents of
    `file` (`-f`); exactly one of them. Checked as `check_text` does."""
    if file is not None:
        if arg is not None:
            raise ConfigError(f"give the prompt either as an argument or with -f FILE, not both (got {arg!r} and -f {file!r})")
        p = Path(file).expanduser()
        try:
            data = p.read_bytes()
        except OSError as e:
            raise ConfigError(f"-f {file!r}: cannot read the prompt file: {e.strerror or e}") from None
        return check_text(_utf8(data, f"prompt file {file!r}"), f"prompt file {file!r}")
    if arg is None:
        raise ConfigError("no prompt: give it as an argument, `-` to read standard input, or -f FILE")
    if arg == "-":
        data = (stdin or sys.stdin.buffer).read()
        return check_text(_utf8(data, "prompt on standard input"), "prompt on standard input")
    return check_text(arg)


def encode_prompt(tokenizer: Any, prompt: str, system: str | None = None, raw: bool = False) -> list[int]:
    """Token ids of `prompt`: through the model's chat template (with an optional system message) unless
    `raw` or the tokenizer has none; raw text gets the tokenizer's special tokens (e.g. BOS)."""
    check_text(prompt)
    if system is not None:
        check_text(system, "system message")
    template = getattr(tokenizer, "chat_template", None)
    if raw or not template:
        if system is not None:
            raise ConfigError("--system needs the model's chat template (not with --raw or a model without one)")
        return list(tokenizer(prompt)["input_ids"])
    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def new_token_budget(n_prompt: int, max_new_tokens: int, context_length: int) -> int:
    """How many tokens to decode after a prompt of `n_prompt`: `max_new_tokens`, lowered (with a warning)
    so that prompt + answer stay within the context. ConfigError when new tokens are asked for and the
    prompt leaves room for none: call it before the prefill, so that such a prompt is refused at once."""
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    room = max(0, context_length - n_prompt)
    if max_new_tokens > 0 and room == 0:
        raise ConfigError(f"the prompt of {n_prompt} tokens fills the model's context of {context_length}: no room "
                          f"for a new token (shorten the prompt, or ask for -n 0)")
    if max_new_tokens > room:
        log.warning("the prompt of %d tokens leaves room for %d new tokens in the context of %d: "
                    "stopping there (asked for %d)", n_prompt, room, context_length, max_new_tokens)
        return room
    return max_new_tokens
