"""Byte-level training text with no download: by default, the Python standard library.

Tokens are bytes (ids 0..255) of UTF-8 text files, or the ids of a raw
little-endian uint16 token file (``*.bin`` / ``*.u16``) for larger vocabularies.

Example:
  >>> from jaxtier.examples import data
  >>> tokens = data.load_tokens(data.default_corpus_files(), max_bytes=1 << 20)
  >>> batch = next(data.batches(tokens, batch_size=4, seq_len=128, seed=0))
  >>> batch.shape, batch.dtype
  ((4, 129), dtype('int32'))
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import os
import pathlib
import sysconfig

import numpy as np

__all__ = [
    "DEFAULT_CORPUS_MAX_BYTES",
    "batches",
    "default_corpus_files",
    "load_corpus",
    "load_tokens",
]

# The default corpus is capped so that loading it takes well under a second.
DEFAULT_CORPUS_MAX_BYTES = 20 * 1024 * 1024

_TOKEN_FILE_SUFFIXES = (".bin", ".u16")
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def default_corpus_files() -> list[pathlib.Path]:
  """The ``.py`` files of this interpreter's standard library, sorted.

  Installed third-party packages (``site-packages``, ``dist-packages``) are
  excluded, so the list depends only on the Python installation.

  Returns:
    Paths, sorted by their path relative to ``sysconfig.get_paths()["stdlib"]``.

  Raises:
    ValueError: if the standard library directory holds no ``.py`` file.
  """
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
    files.extend(pathlib.Path(dirpath) / f for f in filenames if f.endswith(".py"))
  files.sort(key=lambda p: p.relative_to(root).as_posix())
  if not files:
    raise ValueError(
        f"default_corpus_files: expected .py files under the standard library "
        f"directory {str(root)!r}, got none; pass text files with --data.")
  return files


def _is_token_file(path) -> bool:
  return str(path).endswith(_TOKEN_FILE_SUFFIXES)


def _read_token_file(path) -> np.ndarray:
  raw = pathlib.Path(path).read_bytes()
  if len(raw) % 2:
    raise ValueError(
        f"load_tokens: expected an even number of bytes in the uint16 token file "
        f"{str(path)!r}, got {len(raw)} bytes; is it really little-endian uint16?")
  return np.frombuffer(raw, dtype="<u2").astype(np.uint16)


def _check_text(path, raw: bytes) -> None:
  """Raises ValueError where `raw` (the bytes of `path`) is not UTF-8 text."""
  nul = raw.find(b"\0")
  try:
    raw.decode("utf-8")
    bad = nul
  except UnicodeDecodeError as e:
    bad = e.start if nul < 0 else min(nul, e.start)
  if bad >= 0:
    raise ValueError(
        f"load_tokens: {str(path)!r} is not UTF-8 text (byte {bad} of {len(raw)} is "
        f"{raw[bad]:#04x}); --data takes UTF-8 text files, or one uint16 token file whose "
        f"name ends in {' or '.join(_TOKEN_FILE_SUFFIXES)}.")


def load_tokens(
    paths: Sequence[str | os.PathLike],
    *,
    max_bytes: int | None = None,
    vocab_size: int = 256,
    require_text: bool = False,
) -> np.ndarray:
  """Reads files into one token array.

  Text files are read as raw bytes (UTF-8 text gives its UTF-8 bytes); each byte
  is one token. A path ending in ``.bin`` or ``.u16`` is read as raw
  little-endian uint16 token ids. Files are concatenated in the given order.

  Args:
    paths: files to read, in order.
    max_bytes: stop reading once this many bytes of input have been read (the
      last file is truncated); ``None`` means no limit.
    vocab_size: every token id must be below this.
    require_text: refuse a file (other than a token file) that is not UTF-8 text.

  Returns:
    uint16 ``[num_tokens]`` token ids.

  Raises:
    ValueError: if ``paths`` is empty, a token file has an odd byte length, a
      token id is ``>= vocab_size``, a file is not text (``require_text``), or no
      tokens were read.
  """
  paths = list(paths)
  if not paths:
    raise ValueError("load_tokens: expected at least one path, got none.")
  if max_bytes is not None and max_bytes <= 0:
    raise ValueError(f"load_tokens: expected max_bytes > 0 or None, got {max_bytes}.")
  chunks = []
  total_bytes = 0
  for path in paths:
    if max_bytes is not None and total_bytes >= max_bytes:
      break
    if _is_token_file(path):
      tokens = _read_token_file(path)
      if max_bytes is not None:
        tokens = tokens[:(max_bytes - total_bytes) // 2]
      total_bytes += 2 * tokens.size
      if tokens.size and int(tokens.max()) >= vocab_size:
        bad = int(np.argmax(tokens >= vocab_size))
        raise ValueError(
            f"load_tokens: expected token ids < vocab_size={vocab_size} in "
            f"{str(path)!r}, got id {int(tokens[bad])} at index {bad}; use a "
            f"model config with a larger vocab_size.")
    else:
      raw = pathlib.Path(path).read_bytes()
      if require_text:
        _check_text(path, raw)
      if max_bytes is not None:
        raw = raw[:max_bytes - total_bytes]
      total_bytes += len(raw)
      tokens = np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)
      if vocab_size < 256 and tokens.size and int(tokens.max()) >= vocab_size:
        raise ValueError(
            f"load_tokens: expected byte values < vocab_size={vocab_size} in "
            f"{str(path)!r}, got {int(tokens.max())}; byte-level text needs "
            f"vocab_size >= 256.")
    chunks.append(tokens)
  tokens = np.concatenate(chunks) if chunks else np.zeros((0,), np.uint16)
  if tokens.size == 0:
    shown = ", ".join(repr(str(p)) for p in paths[:3])
    raise ValueError(
        f"load_tokens: expected a non-empty corpus, got 0 tokens from "
        f"{len(paths)} file(s) ({shown}{', ...' if len(paths) > 3 else ''}).")
  return tokens


def load_corpus(data: str | None = None, *, vocab_size: int = 256) -> np.ndarray:
  """Tokens for the trainer's ``--data`` flag.

  Args:
    data: ``None`` or ``""`` for the standard-library corpus (capped at
      ``DEFAULT_CORPUS_MAX_BYTES`` bytes), else comma-separated text files or
      one uint16 token file.
    vocab_size: every token id must be below this.

  Returns:
    uint16 ``[num_tokens]`` token ids.

  Raises:
    ValueError: as ``load_tokens`` (a file given that is not text included).
  """
  if not data:
    return load_tokens(default_corpus_files(), max_bytes=DEFAULT_CORPUS_MAX_BYTES,
                       vocab_size=vocab_size)
  paths = [p.strip() for p in data.split(",") if p.strip()]
  return load_tokens(paths, vocab_size=vocab_size, require_text=True)


def batches(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
) -> Iterator[np.ndarray]:
  """An infinite stream of random windows of ``tokens``.

  Each row is ``seq_len + 1`` consecutive tokens starting at a uniformly random
  offset; the stream is a deterministic function of ``seed``.

  Args:
    tokens: int ``[num_tokens]`` token ids.
    batch_size: rows per batch.
    seq_len: model sequence length; rows hold ``seq_len + 1`` tokens (inputs
      plus the shifted targets).
    seed: seed of the ``numpy.random.Generator`` picking the offsets.

  Yields:
    int32 ``[batch_size, seq_len + 1]`` arrays.

  Raises:
    ValueError: if ``batch_size`` or ``seq_len`` is not positive, or the corpus
      has fewer than ``seq_len + 1`` tokens (raised by this call, not on the
      first ``next``).
  """
  tokens = np.asarray(tokens)
  if batch_size <= 0 or seq_len <= 0:
    raise ValueError(
        f"batches: expected batch_size > 0 and seq_len > 0, got "
        f"batch_size={batch_size}, seq_len={seq_len}.")
  if tokens.ndim != 1 or tokens.size < seq_len + 1:
    raise ValueError(
        f"batches: expected a 1-D corpus of at least seq_len + 1 = {seq_len + 1} "
        f"tokens, got shape {tokens.shape}; use more text or a shorter --seq_len.")
  return _random_windows(tokens, batch_size, seq_len, seed)


def _random_windows(tokens, batch_size, seq_len, seed):
  rng = np.random.default_rng(seed)
  window = np.arange(seq_len + 1)
  num_starts = tokens.size - seq_len
  while True:
    starts = rng.integers(0, num_starts, size=batch_size)
    yield tokens[starts[:, None] + window].astype(np.int32)
