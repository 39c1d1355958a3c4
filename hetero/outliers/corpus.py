"""Real text for calibration and evaluation, shipped in `hetero/data/` (see its README for provenance).

Calibrate on one corpus, evaluate on another (mllm-NPU §3.3 profiles on "large corpora" offline): the
two excerpts are disjoint public-domain texts, read with importlib.resources and checked by sha256 so a
damaged install fails loudly instead of silently changing every perplexity.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from hetero.errors import ConfigError, ModelFormatError


@dataclass(frozen=True, slots=True)
class CorpusInfo:
    """One shipped excerpt."""

    file: str  # inside hetero/data/
    sha256: str
    use: str  # "calibration" | "evaluation"
    description: str


CORPORA: dict[str, CorpusInfo] = {
    "sotu": CorpusInfo("sotu_2016_2021.txt", "3acc466ad5dc1393c3f3f8f516a371efb51e3ee5e9f2a24101e5060a7c48b056",
                       "calibration", "US State of the Union addresses 2016-2021 (public domain)"),
    "austen": CorpusInfo("austen_emma.txt", "c3cbbd75bee4edae9d00760311f2c63a0e2f8673c6c5b011ef366c6a6b10b652",
                         "evaluation", "Jane Austen, Emma, vol. I ch. I-XIII (public domain)"),
}
DEFAULT_CALIBRATION = "sotu"
DEFAULT_EVALUATION = "austen"


def load_corpus(name: str) -> str:
    """The text of a shipped corpus (`CORPORA`) or of a UTF-8 file path; shipped ones are sha256-checked."""
    info = CORPORA.get(name)
    if info is None:
        p = Path(name).expanduser()
        if not p.is_file():
            raise ConfigError(f"corpus must be one of {sorted(CORPORA)} or a text file path, got {name!r}")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"corpus {name!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                              f"{e.start})") from None
        except OSError as e:
            raise ConfigError(f"corpus {name!r} cannot be read: {e.strerror or e}") from e
        if "\x00" in text or not text.strip():
            raise ConfigError(f"corpus {name!r} is {'binary' if text.strip() else 'empty'}: expected UTF-8 text")
        return text
    data = resources.files("hetero.data").joinpath(info.file).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != info.sha256:
        raise ModelFormatError(f"corpus {name!r} ({info.file}) is damaged: sha256 {digest[:16]}…, expected {info.sha256[:16]}…")
    return data.decode("utf-8")


def corpus_id(name: str, text: str) -> str:
    """A short content id of a corpus text (name + sha256 prefix), recorded with calibration results."""
    return f"{Path(name).name}:{hashlib.sha256(text.encode('utf-8')).hexdigest()[:12]}"


@functools.cache
def _evaluation_ids(model_path: str | None) -> tuple[int, ...]:
    from hetero.loader import load_model

    return tuple(load_model(model_path).tokenizer(load_corpus(DEFAULT_EVALUATION))["input_ids"])


def prompt_ids(model_path: str | None, n: int, window: int = 0) -> np.ndarray:
    """Tokens [window·n, (window+1)·n) of held-out real text (the evaluation corpus) as the model at `model_path`
    (None: the default model) tokenizes it, 1-D int64: a real prompt of n tokens, a different one for each window
    (the benchmarks, `hetero profile`, `hetero npu layout`)."""
    ids = _evaluation_ids(model_path)
    if len(ids) < (window + 1) * n:
        raise ValueError(f"evaluation corpus too short for window {window} of {n} tokens")
    return np.array(ids[window * n : (window + 1) * n], dtype=np.int64)
