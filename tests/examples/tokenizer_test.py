"""The example's BPE vocabulary (jaxtier/examples/tokenizer.py): exact round trips, the cache,
the ids and batches it gives, the vocabulary flags and their errors, and the trainer end to end
on it (CPU, a few seconds: the tokenizer trains on a small corpus into a temporary cache)."""

import dataclasses
import math
import os
import pathlib
import subprocess
import sys

from hypothesis import given, settings, strategies as st
import numpy as np
import pytest

from jaxtier.examples import data, llama, tokenizer, train

pytest.importorskip("tokenizers")

# Texts the corpus (Python source) mostly never holds, and whitespace of every kind.
_TEXTS = [
    "",
    "hello, world",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "  leading and trailing spaces  ",
    "\t\n\r\n\x0b\x0c \u00a0\u2003\u3000\u2028tabs, CRLF, NBSP, em and ideographic spaces",
    "\n\n\n    \n",
    "héllo wörld, naïve café, Ελληνικά, русский, 中文字符, 日本語のテキスト, 한국어",
    "emoji 🙂👍🏽🧑‍🚀 flags 🇫🇷 and ZWJ\u200d, combining e\u0301 and RTL עברית العربية",
    "NUL \x00 and controls \x01\x1b[0m\x7f, replacement \ufffd, BOM \ufeff",
    "x" * 5000 + " " * 300 + "\n" * 50,
    'json = {"a": [1, 2.5e-3, null], "b": "\\u00e9"}; s = f"{x!r:>10}"',
]


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
  """Two UTF-8 files: 40 standard-library modules and unicode text."""
  folder = tmp_path_factory.mktemp("corpus")
  code = folder / "code.py"
  code.write_text("".join(p.read_text("utf-8") for p in data.default_corpus_files()[:40]),
                  encoding="utf-8")
  prose = folder / "prose.txt"
  # (NUL is no text to load_texts: --data refuses a file holding one.)
  prose.write_text("\n".join([t for t in _TEXTS[5:] if "\x00" not in t] * 20),
                   encoding="utf-8")
  return f"{code},{prose}"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="module")
def bpe(text_files, cache):
  return tokenizer.load_bpe(text_files, 32768, cache_dir=cache)


def test_round_trips_text_exactly(bpe):
  for text in _TEXTS:
    ids = bpe.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert bpe.decode(ids) == text, repr(text)
    assert ids.size == 0 or (0 <= ids.min() and ids.max() < bpe.vocab_size)
  batch = bpe.encode_batch(_TEXTS)
  assert [bpe.decode(ids) for ids in batch] == _TEXTS
  # Merges learned: code takes fewer tokens than bytes.
  code = _TEXTS[2]
  assert bpe.encode(code).size < len(code.encode()) / 2


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_round_trips_any_text(bpe, text):
  assert bpe.decode(bpe.encode(text)) == text


def test_split_changes_no_token(bpe, text_files):
  text = open(text_files.split(",")[0], encoding="utf-8", newline="").read()[:100_000]
  pieces = tokenizer._split(text, chunk_chars=500)
  assert len(pieces) > 20 and "".join(pieces) == text
  np.testing.assert_array_equal(np.concatenate(bpe.encode_batch(pieces)), bpe.encode(text))


def test_corpus_ids_below_vocab_and_batches_int32(text_files, cache, capsys):
  tok, tokens = tokenizer.load_corpus(text_files, 32768, cache_dir=cache)
  assert tokens.dtype == np.int32 and tokens.ndim == 1
  assert 0 <= tokens.min() and tokens.max() < tok.trained_vocab_size <= tok.vocab_size == 32768
  texts = [open(p, encoding="utf-8", newline="").read() for p in text_files.split(",")]
  assert tok.decode(tokens) == "".join(texts)  # the files, encoded in order and concatenated
  batch = next(data.batches(tokens, batch_size=4, seq_len=64, seed=0))
  assert batch.shape == (4, 65) and batch.dtype == np.int32
  # This corpus is too small for 32768 ids: said, and the model keeps the size asked for.
  assert tok.trained_vocab_size < 32768
  tokenizer.load_bpe(text_files, 65536, cache_dir=cache)
  out = capsys.readouterr().out
  assert "has merges for only" in out and "the model keeps vocab_size=65,536" in out


def test_cache_is_reused_and_keyed(tmp_path, text_files, monkeypatch, capsys):
  import tokenizers

  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  small = tmp_path / "small.txt"
  small.write_text("\n".join(t for t in _TEXTS if "\x00" not in t) * 10, encoding="utf-8")
  trained = []
  real_train = tokenizer.train_bpe
  monkeypatch.setattr(tokenizer, "train_bpe", lambda *a, **k: trained.append(a[1]) or
                      real_train(*a, **k))
  first, tokens = tokenizer.load_corpus(str(small), 32768)
  assert trained == [32768] and "training a byte-level BPE tokenizer" in capsys.readouterr().out
  assert first.path.parent == tmp_path / "xdg" / "jaxtier" / "tokenizers"
  assert sorted(os.listdir(first.path)) == ["meta.json", "tokenizer.json", "tokens.npy"]
  stamps = {f: os.stat(first.path / f).st_mtime_ns for f in os.listdir(first.path)}

  again, tokens_again = tokenizer.load_corpus(str(small), 32768)
  assert trained == [32768] and "from the cache" in capsys.readouterr().out  # not retrained
  assert again.path == first.path and again.trained_vocab_size == first.trained_vocab_size
  np.testing.assert_array_equal(tokens_again, tokens)
  assert {f: os.stat(first.path / f).st_mtime_ns for f in os.listdir(first.path)} == stamps

  # Another vocabulary size, corpus or tokenizers version is another entry, trained anew.
  assert tokenizer.load_bpe(str(small), 65536).path != first.path
  small.write_text("changed", encoding="utf-8")
  changed = tokenizer.load_bpe(str(small), 32768)
  assert changed.path != first.path and trained == [32768, 65536, 32768]
  assert changed.decode(changed.encode("changed")) == "changed"
  monkeypatch.setattr(tokenizers, "__version__", "0.0.0")
  assert tokenizer.load_bpe(str(small), 32768).path not in (first.path, changed.path)
  assert trained == [32768, 65536, 32768, 32768]


def test_vocab_flags_checked_and_configs_follow():
  for tok, size in (("bpe", 1000), ("bpe", 50_000), ("bpe", 256)):
    with pytest.raises(ValueError, match=r"--tokenizer=bpe: expected one of 32768, 65536, "
                       r"131072\."):
      tokenizer.vocab_size_for(tok, size)
  with pytest.raises(ValueError, match=r"--vocab_size=32768 with --tokenizer=byte: byte-level "
                     r"text has 256 ids; leave --vocab_size unset"):
    tokenizer.vocab_size_for("byte", 32768)
  with pytest.raises(ValueError, match="--tokenizer"):
    tokenizer.vocab_size_for("sentencepiece", None)
  assert tokenizer.vocab_size_for("byte", None) == tokenizer.vocab_size_for("byte", 256) == 256
  assert tokenizer.vocab_size_for("bpe", None) == 32768
  tiny = llama.CONFIGS["tiny"]
  assert tokenizer.model_config(tiny) is tiny  # byte: the config as it was
  for size in tokenizer.BPE_VOCAB_SIZES:
    cfg = tokenizer.model_config(tiny, "bpe", size)
    assert cfg == dataclasses.replace(tiny, vocab_size=size)
    assert llama.param_count(cfg) - llama.param_count(tiny) == 2 * 128 * (size - 256)
  with pytest.raises(ValueError, match="expected one of 32768, 65536, 131072"):
    train.run(config_name="tiny", tokenizer="bpe", vocab_size=40_000, progress=False)


def test_missing_tokenizers_says_pip_install(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers: ImportError
  with pytest.raises(tokenizer.TokenizersMissingError, match=r"pip install tokenizers"):
    tokenizer.load_bpe(None, 32768, cache_dir=tmp_path)
  assert issubclass(tokenizer.TokenizersMissingError, ImportError)


def test_load_texts_refuses_token_files_and_non_text(tmp_path):
  token_file = tmp_path / "t.u16"
  np.array([1, 2, 300], "<u2").tofile(token_file)
  with pytest.raises(ValueError, match="is a uint16 token file"):
    tokenizer.load_bpe(str(token_file), 32768, cache_dir=tmp_path)
  binary = tmp_path / "b.txt"
  binary.write_bytes(b"ok\xff\x00")
  with pytest.raises(ValueError, match="is not UTF-8 text"):
    tokenizer.load_bpe(str(binary), 32768, cache_dir=tmp_path)
  # The default corpus as text: the bytes load_corpus reads, capped as there.
  paths, max_bytes = data.corpus_files(None)
  texts = data.load_texts(paths[:5], max_bytes=1000)
  raw = b"".join(pathlib.Path(p).read_bytes() for p in paths[:5])[:1000]
  assert max_bytes == data.DEFAULT_CORPUS_MAX_BYTES
  assert "".join(texts) == raw.decode("utf-8", errors="replace")


@pytest.mark.slow
def test_run_tiny_bpe_end_to_end(text_files, cache, monkeypatch, capsys):
  monkeypatch.setenv("XDG_CACHE_HOME", str(cache.parent / "xdg-run"))
  result = train.run(config_name="tiny", tokenizer="bpe", vocab_size=32768, data=text_files,
                     steps=3, batch_size=2, seq_len=32, offload="none", log_every=1,
                     progress=False)
  cfg = dataclasses.replace(llama.CONFIGS["tiny"], vocab_size=32768)
  assert result["vocab_size"] == 32768 and result["num_params"] == llama.param_count(cfg)
  assert len(result["losses"]) == 3 and all(math.isfinite(x) for x in result["losses"])
  assert abs(result["first_loss"] - math.log(32768)) < 1.0  # the init's loss: ln(vocab)
  out = capsys.readouterr().out
  assert f"config tiny: {llama.param_count(cfg):,} params" in out and "(bpe, vocab 32,768)" in out


@pytest.mark.slow
def test_cli_vocabulary_flags_reach_plan_and_train(tmp_path):
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
  cli = lambda *args: subprocess.run([sys.executable, "-m", "jaxtier", *args], text=True,
                                     capture_output=True, env=env, cwd=tmp_path, timeout=120)
  out = cli("plan", "--config=tiny", "--tokenizer=bpe", "--vocab_size=65536")
  assert out.returncode == 0, out.stderr[-2000:]
  cfg = dataclasses.replace(llama.CONFIGS["tiny"], vocab_size=65536)
  assert f"config tiny: {llama.param_count(cfg):,} params (bpe, vocab 65,536)" in out.stdout
  bad = cli("train", "--tokenizer=bpe", "--vocab_size=1000")
  assert bad.returncode == 2  # a usage error, said where the flags are parsed
  assert bad.stderr == ("python -m jaxtier train: --vocab_size=1000 with --tokenizer=bpe: "
                        "expected one of 32768, 65536, 131072; python -m jaxtier train --help "
                        "lists its flags\n")
  assert not (tmp_path / "cache" / "jaxtier" / "tokenizers").exists()  # refused before training
