"""Byte-level training text with no download: by default, the Python standard library.

Tokens are bytes (ids 0..255) of UTF-8 text files, or the ids of a raw
little-endian uint16 token file (``*.bin`` / ``*.u16``) for larger vocabularies.
``corpus_files`` and ``load_texts`` give the same corpus as text, for a trained
tokenizer (``tokenizer.py``: the trainer's ``--tokenizer=bpe``).

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
    "MAX_CORPUS_PASSES",
    "batches",
    "corpus_files",
    "corpus_size_warning",
    "default_corpus_files",
    "load_corpus",
    "load_texts",
    "load_tokens",
    "unreadable",
]

# The default corpus is capped so that loading it takes well under a second.
DEFAULT_CORPUS_MAX_BYTES = 20 * 1024 * 1024

# Passes over the corpus that a run's steps may read before `corpus_size_warning` warns.
MAX_CORPUS_PASSES = 10

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


def unreadable(path, caller: str, error: OSError) -> ValueError:
  """The ValueError for a data file `path` that `error` kept `caller` from reading: it names
  the file, why, and what --data takes."""
  why = "it is a directory" if isinstance(error, IsADirectoryError) else (
      "no such file" if isinstance(error, FileNotFoundError) else error.strerror or str(error))
  return ValueError(
      f"{caller}: cannot read the data file {str(path)!r} ({why}); pass --data as "
      f"comma-separated text files, or one uint16 token file (.bin, .u16).")


def _read_bytes(path, caller: str) -> bytes:
  """The bytes of the data file `path` (ValueError: `unreadable`)."""
  try:
    return pathlib.Path(path).read_bytes()
  except OSError as e:
    raise unreadable(path, caller, e) from e


def _read_token_file(path) -> np.ndarray:
  raw = _read_bytes(path, "load_tokens")
  if len(raw) % 2:
    raise ValueError(
        f"load_tokens: expected an even number of bytes in the uint16 token file "
        f"{str(path)!r}, got {len(raw)} bytes; is it really little-endian uint16?")
  return np.frombuffer(raw, dtype="<u2").astype(np.uint16)


def _check_text(path, raw: bytes, caller: str = "load_tokens") -> None:
  """Raises ValueError where `raw` (the bytes of `path`) is not UTF-8 text."""
  nul = raw.find(b"\0")
  try:
    raw.decode("utf-8")
    bad = nul
  except UnicodeDecodeError as e:
    bad = e.start if nul < 0 else min(nul, e.start)
  if bad >= 0:
    alternative = (f", or one uint16 token file whose name ends in "
                   f"{' or '.join(_TOKEN_FILE_SUFFIXES)}" if caller == "load_tokens" else
                   " (a tokenizer trains on text)")
    raise ValueError(
        f"{caller}: {str(path)!r} is not UTF-8 text (byte {bad} of {len(raw)} is "
        f"{raw[bad]:#04x}); --data takes UTF-8 text files{alternative}.")


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
    raise ValueError("load_tokens: expected at least one path (--data), got none.")
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
      raw = _read_bytes(path, "load_tokens")
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
  paths, max_bytes = corpus_files(data)
  return load_tokens(paths, max_bytes=max_bytes, vocab_size=vocab_size,
                     require_text=bool(data))


def corpus_files(data: str | None = None) -> tuple[list[str | pathlib.Path], int | None]:
  """The files that the trainer's ``--data`` flag names, and the cap on bytes read.

  Args:
    data: as ``load_corpus``.

  Returns:
    ``(paths, max_bytes)``: for ``None`` or ``""`` the standard library's files
    and ``DEFAULT_CORPUS_MAX_BYTES``, else the comma-separated paths given (as
    strings) and ``None`` (no cap).

  Raises:
    ValueError: as ``default_corpus_files``.
  """
  if not data:
    return default_corpus_files(), DEFAULT_CORPUS_MAX_BYTES
  return [p.strip() for p in data.split(",") if p.strip()], None


def load_texts(
    paths: Sequence[str | os.PathLike],
    *,
    max_bytes: int | None = None,
    require_text: bool = False,
) -> list[str]:
  """Reads text files as strings: the corpus ``load_tokens`` reads, as text.

  The same bytes as ``load_tokens`` are read (the same ``max_bytes`` cut); a file
  that is not UTF-8 (allowed only without ``require_text``: the standard
  library holds two) is decoded with U+FFFD for its bad bytes, as is a UTF-8
  character cut by ``max_bytes``.

  Args:
    paths: text files to read, in order.
    max_bytes: stop once this many bytes have been read; ``None``: no limit.
    require_text: refuse a file that is not UTF-8 text.

  Returns:
    One string per file read (files past ``max_bytes`` are not read).

  Raises:
    ValueError: if ``paths`` is empty, one is a token file (``*.bin`` /
      ``*.u16``: already token ids), a file is not text (``require_text``), or
      no text was read.
  """
  paths = list(paths)
  if not paths:
    raise ValueError("load_texts: expected at least one path (--data), got none.")
  texts = []
  total_bytes = 0
  for path in paths:
    if max_bytes is not None and total_bytes >= max_bytes:
      break
    if _is_token_file(path):
      raise ValueError(
          f"load_texts: {str(path)!r} is a uint16 token file (already token ids); a "
          f"tokenizer trains on text: pass UTF-8 text files (or use --tokenizer=byte).")
    raw = _read_bytes(path, "load_texts")
    if require_text:
      _check_text(path, raw, "load_texts")
    if max_bytes is not None:
      raw = raw[:max_bytes - total_bytes]
    total_bytes += len(raw)
    texts.append(raw.decode("utf-8", errors="replace"))
  if not total_bytes:
    raise ValueError(
        f"load_texts: expected a non-empty corpus, got 0 bytes from {len(paths)} file(s).")
  return texts


def batches(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    start: int = 0,
) -> Iterator[np.ndarray]:
  """An infinite stream of random windows of ``tokens``.

  Each row is ``seq_len + 1`` consecutive tokens starting at a uniformly random
  offset; the stream is a deterministic function of ``seed``, and with ``start=n`` it is that
  stream from its batch ``n`` on (a resumed run reads the batches an uninterrupted one reads).

  Args:
    tokens: int ``[num_tokens]`` token ids.
    batch_size: rows per batch.
    seq_len: model sequence length; rows hold ``seq_len + 1`` tokens (inputs
      plus the shifted targets).
    seed: seed of the ``numpy.random.Generator`` picking the offsets.
    start: batches of the stream to skip (>= 0).

  Yields:
    int32 ``[batch_size, seq_len + 1]`` arrays.

  Raises:
    ValueError: if ``batch_size`` or ``seq_len`` is not positive, or the corpus
      has fewer than ``seq_len + 1`` tokens (raised by this call, not on the
      first ``next``).
  """
  tokens = np.asarray(tokens)
  if batch_size <= 0 or seq_len <= 0 or start < 0:
    raise ValueError(
        f"batches: expected batch_size > 0, seq_len > 0 and start >= 0, got "
        f"batch_size={batch_size}, seq_len={seq_len}, start={start}.")
  if tokens.ndim != 1 or tokens.size < seq_len + 1:
    raise ValueError(
        f"batches: expected a 1-D corpus of at least seq_len + 1 = {seq_len + 1} "
        f"tokens, got shape {tokens.shape}; use more text or a shorter --seq_len.")
  return _random_windows(tokens, batch_size, seq_len, seed, start)


def _random_windows(tokens, batch_size, seq_len, seed, start):
  rng = np.random.default_rng(seed)
  window = np.arange(seq_len + 1)
  num_starts = tokens.size - seq_len
  for _ in range(start):  # the offsets of the batches skipped, drawn as the stream draws them
    rng.integers(0, num_starts, size=batch_size)
  while True:
    starts = rng.integers(0, num_starts, size=batch_size)
    yield tokens[starts[:, None] + window].astype(np.int32)


def corpus_size_warning(num_tokens: int, batch_size: int, seq_len: int,
                        steps: int) -> str | None:
  """Why a corpus of ``num_tokens`` tokens is small for ``steps`` batches of ``batch_size`` rows
  of ``seq_len + 1`` tokens, else None.

  It is small when one step's batch holds more tokens than the corpus, or when the steps read
  it more than ``MAX_CORPUS_PASSES`` times over: the model then learns that text by heart, and
  its loss says little.

  Returns:
    A sentence naming the corpus size, the tokens per step and the passes over the corpus, or
    None.
  """
  per_step = batch_size * (seq_len + 1)
  passes = steps * per_step / max(num_tokens, 1)
  if per_step <= num_tokens and passes <= MAX_CORPUS_PASSES:
    return None
  batch = f"{per_step:,} tokens ({batch_size} x {seq_len + 1})"
  read = f"{'read' if steps != 1 else 'reads'} it {passes:,.1f} times over"
  if per_step > num_tokens:
    why = f"fewer than one step's batch of {batch}: {steps:,} step{'s' * (steps != 1)} {read}"
  else:
    why = f"{steps:,} steps of {batch} {read}, more than {MAX_CORPUS_PASSES}"
  return (f"the corpus is {num_tokens:,} tokens, {why}; use "
          "more --data, or fewer --steps, a smaller --batch_size or --seq_len")
