"""Calibration (mllm-NPU §3.3, offline profiling): activation statistics of every site on real text.

The float model runs over a corpus in windows, one layer at a time over all of them, observing every site input
(`model.observed`): absmax, median and percentiles of |x| and both tails, per-channel maxima and outlier counts per
candidate threshold (a second pass over the layer's site inputs, kept from the first), and the |x| histogram. One
versioned `.npz` beside the model's cache entry, written atomically, validated on load. Nothing calibrates at
prefill time. Details: docs/design.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import dataclasses
import io
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetero.weights import SITES
from hetero.errors import ConfigError, ModelFormatError
from hetero.outliers.corpus import DEFAULT_CALIBRATION, corpus_id, load_corpus
from hetero.outliers.rotate import block_hadamard
from hetero import shipped
from hetero.paths import atomic_path, cache_dir, cache_unwritable, cached, entry_lock, forget, read_record, write_record

if TYPE_CHECKING:
    import torch

    from hetero.model import Observer

log = logging.getLogger(__name__)

CALIBRATION_VERSION = 2  # 2: + p99 / p99.5 candidates and the |x| histogram (`SiteStats.hist_abs`)
PERCENTILES = (99.0, 99.5, 99.9, 99.99, 99.999, 100.0)  # candidate clipping points of |x|; 100 = absmax
DEFAULT_TOKENS = 4096
DEFAULT_WINDOW = 512
_LOG2_LO, _LOG2_HI, _BINS_PER_OCTAVE = -24.0, 16.0, 64
# The user's calibration (`hetero calibrate`) is kept beside the default one (the package's, or computed at first
# use), never over it, so that the default answers stay the shipped calibration's, the same on every machine; a run
# uses it only when asked to: HETERO_CALIBRATION=user.
CALIBRATION_ENV = "HETERO_CALIBRATION"
DEFAULT_FILE, USER_FILE = "calibration.npz", "calibration-user.npz"
_NBINS = int((_LOG2_HI - _LOG2_LO) * _BINS_PER_OCTAVE)


def site_dims(cfg) -> dict[str, int]:
    """Input width of each site."""
    return {"attn_in": cfg.hidden, "o_in": cfg.q_dim, "ffn_in": cfg.hidden, "down_in": cfg.ffn}


@dataclass(frozen=True, slots=True)
class SiteStats:
    """Calibrated statistics of one site's activations x [tokens, channels]."""

    absmax: float
    median_abs: float
    pct_abs: tuple[float, ...]  # percentile p of |x| for p in PERCENTILES
    pct_pos: tuple[float, ...]  # upper tail: value v with P(x > v) = 1 - p/100
    pct_neg: tuple[float, ...]  # lower tail: value v (<= 0) with P(x < v) = 1 - p/100
    channel_absmax: np.ndarray  # float32 [channels]
    counts: np.ndarray  # int64 [len(PERCENTILES), channels]: tokens with |x| > pct_abs[p] per channel
    hist_abs: np.ndarray | None = None  # float64 [_NBINS]: counts of |x| > 0 in log2 bins (1/64 octave)
    n_values: int = 0  # |x| values seen (zeros included)

    def scale(self, percentile: float) -> float:
        """Activation scale s that maps the p-th percentile of |x| to 127."""
        t = self.pct_abs[_pidx(percentile)]
        return t / 127.0 if t > 0 else 1.0

    def importance(self, percentile: float) -> float:
        """§3.3: largest outlier / quantization scale (= 127·absmax/t_p)."""
        return self.absmax / self.scale(percentile)

    def channel_counts(self, percentile: float) -> np.ndarray:
        return self.counts[_pidx(percentile)]

    def mean_square(self) -> float:
        """E[x²] over all values, from the histogram (bin centres); 0 without a histogram."""
        if self.hist_abs is None or self.n_values <= 0:
            return 0.0
        centres = 2.0 ** (_LOG2_LO + (np.arange(_NBINS) + 0.5) / _BINS_PER_OCTAVE)
        return float((self.hist_abs * centres * centres).sum() / self.n_values)

    def pruning_error(self, percentile: float, pruned_percentile: float) -> float:
        """Relative squared error that dropping this site's shadow adds: (clipping energy beyond t_pruned
        + the coarser grid's rounding noise (s_pruned² - s²)/12) / E[x²]. Needs the histogram."""
        ms = self.mean_square()
        if ms <= 0:
            return 0.0
        s, sp = self.scale(percentile), self.scale(pruned_percentile)
        return (self.clip_energy(self.pct_abs[_pidx(pruned_percentile)]) + max(sp * sp - s * s, 0.0) / 12) / ms

    def clip_energy(self, t: float) -> float:
        """Mean over all values of (|x| - t)² for |x| > t, from the histogram (bin centres): the squared
        error that clipping at t adds per activation value (0 without a histogram)."""
        if self.hist_abs is None or self.n_values <= 0:
            return 0.0
        centres = 2.0 ** (_LOG2_LO + (np.arange(_NBINS) + 0.5) / _BINS_PER_OCTAVE)
        over = np.clip(centres - t, 0.0, None)
        return float((self.hist_abs * over * over).sum() / self.n_values)


def _pidx(percentile: float) -> int:
    for i, p in enumerate(PERCENTILES):
        if abs(p - percentile) < 1e-9:
            return i
    raise ConfigError(f"percentile must be one of the calibrated {PERCENTILES}, got {percentile!r}")


@dataclass(frozen=True, slots=True)
class CalibrationStats:
    """Calibration of one model on one corpus: `sites[(layer, site)]` for every layer and site."""

    model_fingerprint: str
    model_name: str
    n_layers: int
    dims: dict[str, int]  # site -> channels
    corpus: str  # corpus id (name:sha256 prefix)
    n_tokens: int
    window: int
    sites: dict[tuple[int, str], SiteStats]
    version: int = CALIBRATION_VERSION

    def validate_for(self, model) -> None:
        """Raise ConfigError unless these statistics belong to `model` (hash and shapes)."""
        if self.model_fingerprint != model.fingerprint:
            raise ConfigError(
                f"calibration is for model {self.model_fingerprint} ({self.model_name}), "
                f"not for {model.fingerprint} ({model.name}): run `hetero calibrate` for this model"
            )
        want = site_dims(model.config)
        if self.n_layers != model.config.n_layers or self.dims != want:
            raise ConfigError(f"calibration shapes {self.n_layers} layers {self.dims} do not match the model's "
                              f"{model.config.n_layers} layers {want}")

    # ------------------------------------------------------------------------- file format
    def save(self, path: str | Path) -> Path:
        """Write one .npz (a JSON header + arrays) atomically; ConfigError naming the path if it cannot."""
        path, data = Path(path), self.to_bytes()
        try:
            with atomic_path(path) as tmp:
                tmp.write_bytes(data)
        except OSError as e:
            raise ConfigError(f"calibration output {str(path)!r} cannot be written: {e.strerror or e}") from e
        return path

    def to_bytes(self) -> bytes:
        """The .npz file's bytes: a JSON header + arrays."""
        meta = {
            "version": self.version, "model_fingerprint": self.model_fingerprint, "model_name": self.model_name,
            "n_layers": self.n_layers, "dims": self.dims, "corpus": self.corpus, "n_tokens": self.n_tokens,
            "window": self.window, "percentiles": list(PERCENTILES),
            "sites": {f"{l}/{s}": {"absmax": st.absmax, "median_abs": st.median_abs, "pct_abs": st.pct_abs,
                                   "pct_pos": st.pct_pos, "pct_neg": st.pct_neg, "n_values": st.n_values}
                      for (l, s), st in self.sites.items()},
        }
        arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
        for (l, s), st in self.sites.items():
            arrays[f"chmax/{l}/{s}"] = st.channel_absmax.astype(np.float32)
            arrays[f"counts/{l}/{s}"] = st.counts.astype(np.int64)
            if st.hist_abs is not None:
                arrays[f"hist/{l}/{s}"] = st.hist_abs.astype(np.float64)
        buf = io.BytesIO()
        np.savez_compressed(buf, **arrays)
        return buf.getvalue()

    @classmethod
    def load(cls, path: str | Path, model=None) -> "CalibrationStats":
        """Read a file written by `save`; with `model`, also check it belongs to that model."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"calibration file {str(path)!r} does not exist: run `hetero calibrate`")
        try:
            with np.load(path) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                if meta.get("version") != CALIBRATION_VERSION:
                    raise ConfigError(f"calibration file {path} has version {meta.get('version')!r}, "
                                      f"expected {CALIBRATION_VERSION}: run `hetero calibrate` again")
                if tuple(meta["percentiles"]) != PERCENTILES:
                    raise ConfigError(f"calibration file {path} has percentiles {meta['percentiles']}, expected {PERCENTILES}")
                sites = {}
                for key, d in meta["sites"].items():
                    l, s = key.split("/")
                    sites[(int(l), s)] = SiteStats(float(d["absmax"]), float(d["median_abs"]), tuple(d["pct_abs"]),
                                                   tuple(d["pct_pos"]), tuple(d["pct_neg"]),
                                                   z[f"chmax/{l}/{s}"], z[f"counts/{l}/{s}"],
                                                   z[f"hist/{l}/{s}"] if f"hist/{l}/{s}" in z else None,
                                                   int(d.get("n_values", 0)))
        except ConfigError:
            raise
        except Exception as e:  # zipfile.BadZipFile, EOFError, zlib.error, OSError, ValueError, KeyError, ...
            raise ModelFormatError(f"calibration file {path} is corrupt: {type(e).__name__}: {e}") from e
        stats = cls(meta["model_fingerprint"], meta["model_name"], int(meta["n_layers"]), dict(meta["dims"]),
                    meta["corpus"], int(meta["n_tokens"]), int(meta["window"]), sites)
        for (l, s), st in sites.items():
            if st.channel_absmax.shape != (stats.dims[s],) or st.counts.shape != (len(PERCENTILES), stats.dims[s]):
                raise ModelFormatError(f"calibration file {path}: site {l}/{s} arrays have wrong shapes")
        if model is not None:
            stats.validate_for(model)
        return stats


def user_calibration_chosen() -> bool:
    """Whether runs use the user's calibration (HETERO_CALIBRATION=user) rather than the default one
    (unset, or "default")."""
    value = os.environ.get(CALIBRATION_ENV, "")
    if value not in ("", "default", "user"):
        raise ConfigError(f"{CALIBRATION_ENV} must be 'user' (run the calibration `hetero calibrate` wrote) or "
                          f"'default' (the shipped one, or the one computed at first use), got {value!r}")
    return value == "user"


def calibration_path(model, user: bool | None = None) -> Path:
    """The calibration file of `model` beside its cache entry: the user's (`hetero calibrate`) when `user`, else the
    default one (seeded from the package when it ships one); None: the one in use (`user_calibration_chosen`)."""
    if user is None:
        user = user_calibration_chosen()
    return cache_dir() / "models" / model.fingerprint / (USER_FILE if user else DEFAULT_FILE)


def calibration_in_use(model) -> dict[str, str]:
    """Which calibration runs for `model` and where it is, for `hetero info`: {"in use": ..., "user": ...}."""
    user, default = calibration_path(model, user=True), calibration_path(model, user=False)
    entry = shipped.manifest("calibration").get(model.fingerprint)
    base = (f"shipped with the package (hetero/data/calibration/{entry['file']})" if entry is not None
            else f"computed at first use ({default})")
    if user_calibration_chosen():
        return {"in use": f"the user's, {user} ({CALIBRATION_ENV}=user; unset it to run the default one: {base})"}
    made = f"{user}, not used ({CALIBRATION_ENV}=user runs it)" if user.is_file() else \
        f"none (`hetero calibrate` writes one to {user}; {CALIBRATION_ENV}=user runs it)"
    return {"in use": base, "user": made}


def restore_shipped(model) -> None:
    """Keep the default calibration slot the package's: a file there with other content (an older `hetero calibrate`
    wrote over it) moves to the user slot (is removed if that is taken), with a warning; the default slot is then
    seeded from the package again (`ensure_calibration`). Cheap when nothing is wrong: the record's hash only."""
    entry = shipped.manifest("calibration").get(model.fingerprint)
    path = calibration_path(model, user=False)
    if entry is None or (entry.get("corpus"), entry.get("n_tokens"), entry.get("window")) != \
            (DEFAULT_CALIBRATION, DEFAULT_TOKENS, DEFAULT_WINDOW) or not path.is_file():
        return
    try:
        rec = read_record(path.parent).get(path.name)
    except ValueError:  # an unreadable record: the entry's own check rebuilds it
        return
    if not isinstance(rec, dict) or rec.get("xxh3") == entry.get("xxh3") or shipped.verified("calibration", entry) is None:
        return
    user = calibration_path(model, user=True)
    try:
        with entry_lock(path.parent):
            if not path.is_file():  # another process moved it meanwhile
                return
            moved = not user.exists()
            if moved:
                os.replace(path, user)
                write_record(path.parent, [user.name])
            forget(path.parent, [path.name])
    except OSError as e:
        cache_unwritable(path.parent, e)
        return
    log.warning("the calibration at %s was not the one shipped with the package (an older `hetero calibrate` wrote "
                "it there): %s; the default runs the shipped one again", path,
                f"kept as the user calibration {user} ({CALIBRATION_ENV}=user runs it)" if moved else
                f"removed (a user calibration {user} exists already)")


# ----------------------------------------------------------------------------------- the runs


def token_windows(tokenizer, text: str, n_tokens: int, window: int, offset: int = 0) -> list[torch.Tensor]:
    """n_tokens tokens of `text` from token `offset` on, as non-overlapping windows of `window` (the last
    may be shorter). A tokenizer that starts every text with special tokens (Gemma's <bos>) starts every
    window with them too, as the model always sees them (without <bos> Gemma 3 270M's perplexity on the
    evaluation text is 82.6 instead of ~30 and its activations are not the ones a prompt makes)."""
    import torch

    if n_tokens <= 0 or window <= 1 or offset < 0:
        raise ConfigError(f"tokens must be > 0, window > 1 and offset >= 0, got tokens={n_tokens} window={window} "
                          f"offset={offset}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][offset:]
    if len(ids) < n_tokens:
        log.warning("corpus has only %d tokens after %d, fewer than the %d requested", len(ids), offset, n_tokens)
    lead = _lead_tokens(tokenizer)
    if window - len(lead) <= 1:
        raise ConfigError(f"window {window} leaves no room beside the tokenizer's {len(lead)} leading special tokens")
    ids = torch.tensor(ids[:n_tokens], dtype=torch.long)
    head = torch.tensor(lead, dtype=torch.long)
    return [torch.cat([head, w]) for w in torch.split(ids, window - len(lead)) if w.numel() > 1]


def _lead_tokens(tokenizer) -> list[int]:
    """The special token ids the tokenizer puts before every text (e.g. [<bos>]; [] for most BPE tokenizers)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return list(full[:i])
    return []


def run_sites(cfg, w, ids: torch.Tensor, observe: Observer) -> None:
    """The float layers over `ids` (no logits), calling observe(layer, site, x) on every site input."""
    from hetero import model as ref
    from hetero.model import FloatLinear, observed
    from hetero.torch_backends import TorchBackend

    ref.run_layers(cfg, w, ids, TorchBackend(cfg, w, observed(FloatLinear(w), observe)))


def _hist(v: torch.Tensor) -> torch.Tensor:
    import torch

    v = v[v > 0]
    return torch.histc(torch.log2(v.double()), _NBINS, _LOG2_LO, _LOG2_HI)


def _tail_value(hist: np.ndarray, k: float) -> float:
    """The value above which `k` counts of the (log2-binned) histogram lie, interpolated in log space."""
    if k <= 0:
        return float("nan")
    c = np.cumsum(hist[::-1])  # counts above the lower edge of each bin, from the top
    i = int(np.searchsorted(c, k))
    if i >= len(hist):
        return 0.0
    b = len(hist) - 1 - i  # bin index
    above = c[i] - hist[b]  # counts in higher bins
    frac = (k - above) / hist[b] if hist[b] > 0 else 0.0  # share of bin b needed, from its top
    edge_hi = _LOG2_LO + (b + 1) / _BINS_PER_OCTAVE
    return float(2.0 ** (edge_hi - frac / _BINS_PER_OCTAVE))


def calibrate(model, text: str, n_tokens: int = DEFAULT_TOKENS, window: int = DEFAULT_WINDOW,
              corpus: str = "text", progress: bool = True, online: dict[str, int] | None = None) -> CalibrationStats:
    """Run the float model over `text` (a layer at a time, see module doc and `_calibrate`) and return the statistics.

    online: site -> Hadamard block of the plan's online transforms: those sites are observed as x·T."""
    import torch

    with torch.inference_mode():
        return _calibrate(model, text, n_tokens, window, corpus, progress, online)


def _calibrate(model, text: str, n_tokens: int, window: int, corpus: str, progress: bool,
               online: dict[str, int] | None) -> CalibrationStats:
    """One layer at a time over every window (their hidden states between layers kept, 32 MB at 1B width): the
    first pass's statistics of a layer's sites, then the second pass's counts over the same site inputs, kept
    from the first (so the float layers run once, not twice); the layer's weights then give back their pages
    (`loader.release_pages`), so calibration never holds more than a layer of the model."""
    import torch

    from hetero import model as ref
    from hetero import progress as bars
    from hetero.loader import release_pages
    from hetero.model import FloatLinear, observed
    from hetero.torch_backends import TorchBackend

    if model.tokenizer is None:
        raise ConfigError("calibration needs a model with a tokenizer")
    cfg, w = model.config, model.weights
    wins = token_windows(model.tokenizer, text, n_tokens, window)
    n_seen = sum(x.numel() for x in wins)
    dims = site_dims(cfg)
    online = online or {}
    hs = [ref.embed(w, ids) for ids in wins]  # each window's input to the next layer
    sites: dict[tuple[int, str], SiteStats] = {}
    bar = bars.bar(cfg.n_layers * len(wins), "calibrate", "win", enabled=progress)
    for layer in range(cfg.n_layers):
        pos = {s: torch.zeros(_NBINS, dtype=torch.float64) for s in SITES}
        neg = {s: torch.zeros(_NBINS, dtype=torch.float64) for s in SITES}
        chmax = {s: torch.zeros(dims[s]) for s in SITES}
        n_zero = dict.fromkeys(SITES, 0)
        xmax = dict.fromkeys(SITES, 0.0)  # largest x and largest -x (both tails' extremes)
        xmin = dict.fromkeys(SITES, 0.0)
        seen: dict[str, list[torch.Tensor]] = {s: [] for s in SITES}  # every window's site input, for the counts

        def first(layer: int, site: str, x: torch.Tensor) -> None:
            x = block_hadamard(x, online[site]) if site in online else x.clone()
            seen[site].append(x)
            pos[site] += _hist(x)
            neg[site] += _hist(-x)
            n_zero[site] += int((x == 0).sum())
            chmax[site] = torch.maximum(chmax[site], x.abs().amax(0))
            xmax[site] = max(xmax[site], float(x.max()))
            xmin[site] = min(xmin[site], float(x.min()))

        backend = TorchBackend(cfg, w, observed(FloatLinear(w), first))
        for i, h in enumerate(hs):
            hs[i] = ref.layer_stack(cfg, w, h, backend, range(layer, layer + 1))[0]
            bar.update()
        for site in SITES:
            hp, hn = pos[site].numpy(), neg[site].numpy()
            n = hp.sum() + hn.sum() + n_zero[site]
            ha = hp + hn
            absmax = float(chmax[site].max())
            pa = tuple(absmax if p >= 100 else _tail_value(ha, n * (1 - p / 100)) for p in PERCENTILES)
            pp = tuple(xmax[site] if p >= 100 else _tail_value(hp, n * (1 - p / 100)) for p in PERCENTILES)
            pn = tuple(xmin[site] if p >= 100 else -_tail_value(hn, n * (1 - p / 100)) for p in PERCENTILES)
            thr = torch.tensor(pa, dtype=torch.float32)
            counts = torch.zeros(len(PERCENTILES), dims[site], dtype=torch.int64)
            for x in seen.pop(site):
                counts += (x.abs().unsqueeze(0) > thr.view(-1, 1, 1)).sum(1)
            sites[(layer, site)] = SiteStats(absmax, _tail_value(ha, n * 0.5), pa, pp, pn,
                                             chmax[site].numpy().astype(np.float32), counts.numpy(), ha, int(n))
        lw = w.layers[layer]
        release_pages(*(t for f in dataclasses.fields(lw) if (t := getattr(lw, f.name)) is not None))
    bar.close()
    return CalibrationStats(model.fingerprint, model.name, cfg.n_layers, dims, corpus, n_seen, window, sites)


def ensure_calibration(model, path: str | Path | None = None, corpus: str = DEFAULT_CALIBRATION,
                       n_tokens: int = DEFAULT_TOKENS, window: int = DEFAULT_WINDOW,
                       progress: bool = False, online: dict[str, int] | None = None) -> CalibrationStats:
    """The cached calibration of `model` (validated), computing and saving it first if there is none.

    path None: the calibration in use (`calibration_path`): the default one, seeded from the package's file when
    it ships one for these settings (`shipped_calibration_file`), else computed; or, with HETERO_CALIBRATION=user,
    the user's (`hetero calibrate`), never computed here (a ConfigError when there is none).
    A cache entry (`paths.cached`): its content record is checked at first use; a damaged, truncated or
    older-format file is recalibrated with a warning; processes starting together calibrate once (the
    entry's lock covers the run); an unwritable cache calibrates for this run only.
    online (`calibrate`): part of the model's identity, so a rotated model's fingerprint must name it."""
    if path is None:
        user = user_calibration_chosen()
        path = calibration_path(model, user)
        if user:
            return cached(path.parent, path.name, lambda p: CalibrationStats.load(p, model),
                          lambda: _no_user_calibration(model, path), lambda stats, tmp: None, "user calibration")
        restore_shipped(model)
    path = Path(path)
    package: list[Path] = []  # the package's file, when the build took it

    def build() -> CalibrationStats:
        got = shipped_calibration_file(model, corpus, n_tokens, window)
        if got is not None:
            log.info("calibration of %s from the package (%s)", model.name, got.name)
            package.append(got)
            return CalibrationStats.load(got, model)
        log.info("no calibration at %s: calibrating %s on %s (%d tokens)", path, model.name, corpus, n_tokens)
        if progress:
            print(f"hetero: calibrating {model.name} on {corpus} ({n_tokens} tokens, once; mllm-NPU §3.3 offline "
                  f"profiling), cached at {path}", file=sys.stderr)
        text = load_corpus(corpus)
        return calibrate(model, text, n_tokens, window, corpus_id(corpus, text), progress=progress, online=online)

    def save(stats: CalibrationStats, tmp: Path) -> None:  # the package's file byte for byte (its hash names its plans)
        if package:
            shutil.copyfile(package[0], tmp)
        else:
            tmp.write_bytes(stats.to_bytes())

    return cached(path.parent, path.name, lambda p: CalibrationStats.load(p, model), build, save, "calibration")


def _no_user_calibration(model, path: Path) -> CalibrationStats:
    raise ConfigError(f"{CALIBRATION_ENV}=user, but there is no usable user calibration of {model.name} at {path}: "
                      f"run `hetero calibrate` to make one, or unset {CALIBRATION_ENV} to run the default one")


def shipped_calibration_file(model, corpus: str = DEFAULT_CALIBRATION, n_tokens: int = DEFAULT_TOKENS,
                             window: int = DEFAULT_WINDOW) -> Path | None:
    """The package's calibration file of this model and these settings (its content hash checked), or None.

    The default model's calibration (of its rotated copy, what the default method quantizes) is the same on every
    machine, so it ships as package data (`hetero/data/calibration/`, keyed by model fingerprint in its manifest,
    `hetero.shipped`) and a first run does not spend ~30-40 s computing it. A file that fails its
    content hash is not used."""
    entry = shipped.manifest("calibration").get(model.fingerprint)
    if entry is None or (entry["corpus"], entry["n_tokens"], entry["window"]) != (corpus, n_tokens, window):
        return None
    return shipped.verified("calibration", entry)


def shipped_calibration(model, corpus: str = DEFAULT_CALIBRATION, n_tokens: int = DEFAULT_TOKENS,
                        window: int = DEFAULT_WINDOW) -> CalibrationStats | None:
    """The calibration shipped with the package for this model and these settings (`shipped_calibration_file`),
    or None."""
    path = shipped_calibration_file(model, corpus, n_tokens, window)
    return None if path is None else CalibrationStats.load(path, model)


def load_calibration(model, path: str | Path | None = None) -> CalibrationStats:
    """Load and validate the calibration of `model` (default: its cache entry)."""
    return CalibrationStats.load(path if path is not None else calibration_path(model), model)


def summary(stats: CalibrationStats, percentile: float = 99.99) -> list[dict]:
    """One row per site for tables/plots: absmax, median, scale, importance, outlier channels."""
    rows = []
    for (l, s), st in sorted(stats.sites.items()):
        cnt = st.channel_counts(percentile)
        rows.append({"layer": l, "site": s, "absmax": st.absmax, "median_abs": st.median_abs,
                     "scale": st.scale(percentile), "importance": st.importance(percentile),
                     "outlier_channels": int((cnt > 0).sum()), "outliers": int(cnt.sum()),
                     "channels": int(cnt.size)})
    return rows
