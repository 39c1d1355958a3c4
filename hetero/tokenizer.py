"""A model's tokenizer and chat template, read with `tokenizers` and `jinja2` (what transformers' fast tokenizers
run underneath), so that `hetero run` does not import transformers (~1 s).

`Tokenizer` reads a tokenizer folder as transformers saves it (`tokenizer.json`, `tokenizer_config.json`, and
`chat_template.jinja` or the config's `chat_template`) and gives the same token ids, text and chat prompt as
transformers' `AutoTokenizer` (`tests/test_tokenizer.py` compares them): `tok(text)["input_ids"]`,
`tok.decode(ids, skip_special_tokens=True)`, `tok.apply_chat_template(messages, add_generation_prompt=True)`.
transformers is still what converts a tokenizer that has no `tokenizer.json` (GGUF metadata, a sentencepiece
model): `Tokenizer.of(hf_tokenizer)` wraps what it built.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from hetero.errors import ModelFormatError

# the special tokens transformers hands a chat template (`PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES`)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """A fast tokenizer (`tokenizers.Tokenizer`) with its special tokens and chat template."""

    def __init__(self, backend: Any, special: dict[str, str], chat_template: str | None = None,
                 clean_up_spaces: bool = False):
        self.backend, self.special, self.chat_template = backend, special, chat_template
        # transformers skips the clean-up for BPE models (it strips real spaces before punctuation there)
        self.clean_up_spaces = clean_up_spaces and type(backend.model).__name__ != "BPE"
        self._template: Any = None

    @classmethod
    def from_dir(cls, folder: Path) -> "Tokenizer":
        """The tokenizer saved in `folder` (transformers' `save_pretrained` layout, `tokenizer.json` required)."""
        from tokenizers import Tokenizer as Backend

        try:
            backend = Backend.from_file(str(folder / "tokenizer.json"))
            cfg_file = folder / "tokenizer_config.json"
            cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
            template_file = folder / "chat_template.jinja"
            template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                        else cfg.get("chat_template"))
        except Exception as e:  # OSError, a JSON ValueError, or tokenizers' own Exception on a bad file
            raise ModelFormatError(f"{folder}: unreadable tokenizer ({type(e).__name__}: {e})") from e
        if isinstance(template, list):  # named templates: the one transformers applies by default
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        special = {k: _content(cfg[k]) for k in SPECIAL_TOKENS if cfg.get(k) is not None}
        return cls(backend, special, template, bool(cfg.get("clean_up_tokenization_spaces", False)))

    @classmethod
    def of(cls, hf: Any) -> "Tokenizer":
        """The same tokenizer as transformers' fast tokenizer `hf` (which converted it from GGUF or sentencepiece)."""
        return cls(hf.backend_tokenizer, {k: str(v) for k, v in hf.special_tokens_map.items() if k in SPECIAL_TOKENS},
                   hf.chat_template if isinstance(hf.chat_template, str) else None,
                   bool(getattr(hf, "clean_up_tokenization_spaces", False)))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """`{"input_ids": ids}` of `text`, with the tokenizer's special tokens (e.g. BOS) unless told not to."""
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer encodes one str, got {type(text).__name__}")
        return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """The text of token ids (a sequence, or one id as an int or a 0-d tensor)."""
        ids = [ids] if isinstance(ids, int) or getattr(ids, "ndim", 1) == 0 else ids
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_spaces else text

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary entry `token` (e.g. "<|im_end|>"), None when there is none: a look-up, where
        transformers' `get_vocab()` builds a dict of the whole vocabulary (25 ms for 49k entries)."""
        return self.backend.token_to_id(token)

    def token_id(self, name: str) -> int | None:
        """The id of special token `name` (e.g. "eos_token"), None when the tokenizer has none."""
        tok = self.special.get(name)
        return None if tok is None else self.backend.token_to_id(tok)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id("bos_token")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = False) -> str | list[int]:
        """The chat prompt of `messages` as transformers renders it (its sandboxed jinja2 environment, the special
        tokens as variables); `tokenize`: its ids, without added special tokens (the template writes them)."""
        if self.chat_template is None:
            raise ModelFormatError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _compile(self.chat_template)
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special)
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text


def _content(token: Any) -> str:
    """A special token of tokenizer_config.json: a string, or an AddedToken as a dict."""
    return token["content"] if isinstance(token, dict) else str(token)


def _clean_up(text: str) -> str:
    """transformers' `clean_up_tokenization` (WordPiece-era spaces before punctuation)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _compile(template: str) -> Any:
    """transformers' chat-template environment (`utils.chat_template_utils`): sandboxed, trim_blocks and
    lstrip_blocks, loop controls, `raise_exception`, `strftime_now` and a `tojson` that does not escape HTML."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):
        """`{% generation %}…{% endgeneration %}` (transformers' assistant-mask tag): renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
