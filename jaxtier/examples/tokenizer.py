"""A real vocabulary for the example, with no download: byte-level BPE trained on its corpus.

``--tokenizer=bpe --vocab_size=32768`` (or 65536, 131072) trains a byte-level BPE
tokenizer with the ``tokenizers`` package on the corpus the trainer reads (the
standard library's ``.py`` files, capped as ``data.load_corpus`` caps them, or the
``--data`` text files), once: the tokenizer and the corpus's token ids are cached
under ``$XDG_CACHE_HOME/jaxtier/tokenizers/`` (``~/.cache`` by default), keyed by
the corpus files read (path, size and mtime of each), the byte cap, the vocabulary
size and the ``tokenizers`` version, so a later run loads both in milliseconds.
``--tokenizer=byte`` (the default) is the byte-level corpus of ``data.py``.

Byte-level: the 256 bytes are all in the vocabulary and no normaliser runs, so
any text encodes and decodes back exactly, characters the corpus never held
included.

The model's ``vocab_size`` is the one asked for, also when the corpus is too
small for BPE to find that many merges (the default corpus gives about 91K of
131072 ids): the ids past the tokenizer's own size never occur, their embedding
rows only cost memory, and the config, the parameter count and the plan depend
on the flags alone (``plan`` trains no tokenizer). The trainer says so when it
happens.

Example:
  >>> from jaxtier.examples import tokenizer
  >>> tok, tokens = tokenizer.load_corpus(None, 32768)  # ~10 s once, then cached
  >>> tokens.dtype, int(tokens.max()) < 32768
  (dtype('int32'), True)
  >>> tok.decode(tok.encode("def f(x):\\n  return x\\n"))
  'def f(x):\\n  return x\\n'
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import time
from typing import Any

import numpy as np

from . import data as data_lib

__all__ = [
    "BPE_VOCAB_SIZES",
    "BYTE_VOCAB_SIZE",
    "BpeTokenizer",
    "DEFAULT_BPE_VOCAB_SIZE",
    "TOKENIZERS",
    "TokenizersMissingError",
    "cache_root",
    "load_bpe",
    "load_corpus",
    "model_config",
    "train_bpe",
    "vocab_size_for",
]

TOKENIZERS = ("byte", "bpe")
BYTE_VOCAB_SIZE = 256
BPE_VOCAB_SIZES = (32768, 65536, 131072)
DEFAULT_BPE_VOCAB_SIZE = 32768

# Bump when what is cached changes meaning (the key holds it, so old entries are not read).
_CACHE_FORMAT = 1
# Texts longer than this are split (at boundaries that change no token) so that training and
# encoding spread over the cores; `tokenizers` parallelises over texts, not within one.
_CHUNK_CHARS = 1 << 20
# A newline between two printable ASCII characters that are not spaces is a pre-token boundary
# of the byte-level regex whatever surrounds it: splitting there changes no token.
_SAFE_SPLIT = re.compile(r"(?<=[!-~])\n(?=[!-~])")
_ENCODE_BATCH = 256


class TokenizersMissingError(ImportError):
  """``--tokenizer=bpe`` was asked for and the ``tokenizers`` package is not installed."""


def _tokenizers():
  try:
    import tokenizers  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise TokenizersMissingError(
        "--tokenizer=bpe needs the tokenizers package: pip install tokenizers (or install "
        "jaxtier with its examples extra: pip install 'jaxtier[examples]'; from a checkout: "
        "pip install '.[examples]'), or use --tokenizer=byte.") from None
  return tokenizers


def vocab_size_for(tokenizer: str = "byte", vocab_size: int | None = None) -> int:
  """The vocabulary size of ``--tokenizer`` and ``--vocab_size``, checked.

  Args:
    tokenizer: ``"byte"`` or ``"bpe"``.
    vocab_size: for ``"byte"`` 256 or ``None``; for ``"bpe"`` one of
      ``BPE_VOCAB_SIZES``, or ``None`` for ``DEFAULT_BPE_VOCAB_SIZE``.

  Returns:
    The number of token ids: 256 for ``"byte"``.

  Raises:
    ValueError: for another tokenizer, or a vocabulary size it does not allow.
  """
  if tokenizer not in TOKENIZERS:
    raise ValueError(f"expected --tokenizer in {TOKENIZERS}, got {tokenizer!r}.")
  if tokenizer == "byte":
    if vocab_size not in (None, BYTE_VOCAB_SIZE):
      raise ValueError(
          f"--vocab_size={vocab_size} with --tokenizer=byte: byte-level text has "
          f"{BYTE_VOCAB_SIZE} ids; leave --vocab_size unset, or use --tokenizer=bpe with "
          f"--vocab_size in {', '.join(map(str, BPE_VOCAB_SIZES))}.")
    return BYTE_VOCAB_SIZE
  if vocab_size is None:
    return DEFAULT_BPE_VOCAB_SIZE
  if vocab_size not in BPE_VOCAB_SIZES:
    raise ValueError(
        f"--vocab_size={vocab_size} with --tokenizer=bpe: expected one of "
        f"{', '.join(map(str, BPE_VOCAB_SIZES))}.")
  return vocab_size


def model_config(config: Any, tokenizer: str = "byte", vocab_size: int | None = None) -> Any:
  """``config`` with the vocabulary of ``--tokenizer`` / ``--vocab_size``.

  Args:
    config: a ``llama.LlamaConfig`` (any dataclass with a ``vocab_size`` field).
    tokenizer: as ``vocab_size_for``.
    vocab_size: as ``vocab_size_for``.

  Returns:
    For ``"byte"``, ``config`` itself (unchanged, as before the flags existed);
    for ``"bpe"``, ``dataclasses.replace(config, vocab_size=...)``.

  Raises:
    ValueError: as ``vocab_size_for``.
  """
  size = vocab_size_for(tokenizer, vocab_size)
  if tokenizer == "byte":
    return config
  return dataclasses.replace(config, vocab_size=size)


def cache_root() -> pathlib.Path:
  """Where trained tokenizers are cached: ``$XDG_CACHE_HOME/jaxtier/tokenizers``.

  Returns:
    The directory (not created here); ``~/.cache`` stands for an unset or empty
    ``XDG_CACHE_HOME``.
  """
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "jaxtier" / "tokenizers"


class BpeTokenizer:
  """A trained byte-level BPE tokenizer and the model vocabulary it is for.

  Attributes:
    tokenizer: the ``tokenizers.Tokenizer``.
    vocab_size: the model's vocabulary size (the one asked for); every id is below it.
    trained_vocab_size: the tokenizer's own number of ids, ``<= vocab_size`` (less
      when the corpus was too small for that many merges).
    path: the cache directory it was loaded from or saved to; ``None`` if not cached.
  """

  def __init__(self, tokenizer: Any, vocab_size: int, path: pathlib.Path | None = None):
    self.tokenizer = tokenizer
    self.vocab_size = vocab_size
    self.trained_vocab_size = tokenizer.get_vocab_size()
    self.path = path

  def encode(self, text: str) -> np.ndarray:
    """int32 ``[num_tokens]`` ids of ``text``."""
    return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """int32 ``[num_tokens_i]`` ids of each text, encoded in parallel."""
    encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
    out = []
    for start in range(0, len(texts), _ENCODE_BATCH):
      batch = encode(list(texts[start:start + _ENCODE_BATCH]), add_special_tokens=False)
      out.extend(np.asarray(e.ids, np.int32) for e in batch)
    return out

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """The text of int ``[num_tokens]`` ids (the exact text for ids from ``encode``)."""
    return self.tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                 skip_special_tokens=False)

  def __repr__(self) -> str:
    return (f"BpeTokenizer(vocab_size={self.vocab_size}, "
            f"trained_vocab_size={self.trained_vocab_size}, path={self.path})")


def _split(text: str, chunk_chars: int = _CHUNK_CHARS) -> list[str]:
  """``text`` in pieces of about ``chunk_chars`` characters, cut only where the cut changes no
  token (``_SAFE_SPLIT``); a text with no such place stays whole."""
  pieces, start = [], 0
  while len(text) - start > chunk_chars:
    cut = _SAFE_SPLIT.search(text, start + chunk_chars)
    if cut is None:
      break
    pieces.append(text[start:cut.end()])
    start = cut.end()
  pieces.append(text[start:])
  return pieces


def _chunks(texts: Sequence[str]) -> list[str]:
  return [piece for text in texts for piece in _split(text)]


def train_bpe(texts: Sequence[str], vocab_size: int, *, progress: bool = False) -> Any:
  """Trains a byte-level BPE tokenizer on ``texts`` (no cache: see ``load_bpe``).

  Args:
    texts: the training text, one string per document.
    vocab_size: the most ids it may have (the 256 bytes included); fewer when the
      text runs out of pairs to merge.
    progress: show the ``tokenizers`` trainer's progress bars (on stderr).

  Returns:
    A ``tokenizers.Tokenizer``: byte-level pre-tokenizer and decoder, no normaliser
    and no special tokens, so that every text round-trips exactly.

  Raises:
    TokenizersMissingError: ``tokenizers`` is not installed.
  """
  tk = _tokenizers()
  tok = tk.Tokenizer(tk.models.BPE())
  tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(
      vocab_size=vocab_size, show_progress=progress, special_tokens=[],
      initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
  chunks = _chunks(texts)
  tok.train_from_iterator(chunks, trainer=trainer, length=len(chunks))
  return tok


def _corpus_entries(paths, max_bytes) -> list[list[Any]]:
  """[absolute path, size, mtime_ns] of each file `data.load_texts` reads (a file that cannot
  be read: ValueError, `data.unreadable`)."""
  entries, total = [], 0
  for path in paths:
    if max_bytes is not None and total >= max_bytes:
      break
    try:
      st = os.stat(path)
    except OSError as e:
      raise data_lib.unreadable(path, "--tokenizer=bpe", e) from e
    entries.append([os.path.abspath(path), st.st_size, st.st_mtime_ns])
    total += st.st_size
  return entries


def _cache_dir(entries, max_bytes, vocab_size, cache_dir) -> pathlib.Path:
  tk = _tokenizers()
  key = {"format": _CACHE_FORMAT, "tokenizers": tk.__version__, "vocab_size": vocab_size,
         "max_bytes": max_bytes, "files": entries}
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
  root = cache_root() if cache_dir is None else pathlib.Path(cache_dir)
  return root / f"bpe{vocab_size}-{digest}"


def _write_atomic(path: pathlib.Path, write) -> None:
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  try:
    with open(tmp, "wb") as f:
      write(f)
    os.replace(tmp, path)
  finally:
    if tmp.exists():
      tmp.unlink()


def _say(msg: str) -> None:
  print(msg, flush=True)


def _load_or_train(data, vocab_size, cache_dir, progress):
  """(tokenizer, its texts or None when loaded from the cache, the cache directory)."""
  size = vocab_size_for("bpe", vocab_size)
  paths, max_bytes = data_lib.corpus_files(data)
  if not paths:
    raise ValueError("--tokenizer=bpe: expected at least one --data file, got none.")
  folder = _cache_dir(_corpus_entries(paths, max_bytes), max_bytes, size, cache_dir)
  tk = _tokenizers()
  if (folder / "meta.json").exists():
    t0 = time.perf_counter()
    tok = BpeTokenizer(tk.Tokenizer.from_file(str(folder / "tokenizer.json")), size, folder)
    _say(f"tokenizer: byte-level BPE, {tok.trained_vocab_size:,} of {size:,} ids, from the "
         f"cache {folder} ({(time.perf_counter() - t0) * 1e3:.0f} ms)")
    return tok, None
  texts = data_lib.load_texts(paths, max_bytes=max_bytes, require_text=bool(data))
  num_bytes = sum(len(t.encode("utf-8")) for t in texts)
  _say(f"tokenizer: training a byte-level BPE tokenizer of {size:,} ids on {len(texts):,} "
       f"file(s), {num_bytes / 2**20:.1f} MiB (once: it is cached) ...")
  t0 = time.perf_counter()
  tok = BpeTokenizer(train_bpe(texts, size, progress=progress), size, folder)
  _say(f"tokenizer: trained in {time.perf_counter() - t0:.1f} s")
  if tok.trained_vocab_size < size:
    _say(f"note: the corpus ({num_bytes / 2**20:.1f} MiB) has merges for only "
         f"{tok.trained_vocab_size:,} of the {size:,} ids asked for; the model keeps "
         f"vocab_size={size:,} (ids {tok.trained_vocab_size:,} and up never occur); more text "
         "(--data) fills the vocabulary")
  meta = {"vocab_size": size, "trained_vocab_size": tok.trained_vocab_size,
          "tokenizers": tk.__version__, "data": data or "", "max_bytes": max_bytes,
          "num_files": len(texts), "num_bytes": num_bytes}
  try:
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / "tokenizer.json",
                  lambda f: f.write(tok.tokenizer.to_str().encode("utf-8")))
    _write_atomic(folder / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
  except OSError as e:
    tok.path = None
    _say(f"warning: could not cache the tokenizer in {folder} ({e}); the next run trains it "
         "again (set XDG_CACHE_HOME to a writable directory)")
  return tok, texts


def load_bpe(
    data: str | None = None,
    vocab_size: int | None = DEFAULT_BPE_VOCAB_SIZE,
    *,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
) -> BpeTokenizer:
  """The byte-level BPE tokenizer of the trainer's corpus: from the cache, or trained (and
  cached) now.

  Args:
    data: the trainer's ``--data``: ``None``/``""`` for the standard-library corpus
      (capped as ``data.load_corpus`` caps it), else comma-separated UTF-8 text files.
    vocab_size: one of ``BPE_VOCAB_SIZES``; ``None``: ``DEFAULT_BPE_VOCAB_SIZE``.
    cache_dir: cache directory; ``None``: ``cache_root()``.
    progress: show the trainer's progress bars when it trains.

  Returns:
    The tokenizer (its ``path``: the cache directory, or ``None`` if it could not be
    written).

  Raises:
    ValueError: a vocabulary size not allowed, a token file, or a file that is not
      UTF-8 text (``data.load_texts``).
    OSError: a file that cannot be read.
    TokenizersMissingError: ``tokenizers`` is not installed.
  """
  return _load_or_train(data, vocab_size, cache_dir, progress)[0]


def load_corpus(
    data: str | None = None,
    vocab_size: int | None = DEFAULT_BPE_VOCAB_SIZE,
    *,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
) -> tuple[BpeTokenizer, np.ndarray]:
  """The trainer's corpus as BPE token ids (``--tokenizer=bpe``), both cached.

  Files are encoded in order and concatenated, as ``data.load_corpus`` concatenates
  their bytes.

  Args:
    data: as ``load_bpe``.
    vocab_size: as ``load_bpe``.
    cache_dir: as ``load_bpe``.
    progress: as ``load_bpe``.

  Returns:
    ``(tokenizer, tokens)``: the ``load_bpe`` tokenizer, and int32 ``[num_tokens]``
    ids, each ``< tokenizer.vocab_size``.

  Raises:
    As ``load_bpe``.
  """
  tok, texts = _load_or_train(data, vocab_size, cache_dir, progress)
  cached = tok.path / "tokens.npy" if tok.path is not None else None
  if cached is not None and cached.exists():
    return tok, np.load(cached)
  if texts is None:
    paths, max_bytes = data_lib.corpus_files(data)
    texts = data_lib.load_texts(paths, max_bytes=max_bytes, require_text=bool(data))
  t0 = time.perf_counter()
  pieces = tok.encode_batch(_chunks(texts))
  tokens = np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)
  _say(f"tokenizer: encoded the corpus, {tokens.size:,} tokens, in "
       f"{time.perf_counter() - t0:.1f} s")
  if cached is not None:
    try:
      _write_atomic(cached, lambda f: np.save(f, tokens))
    except OSError as e:
      _say(f"warning: could not cache the corpus's token ids in {cached} ({e})")
  return tok, tokens
