"""The example data pipeline (jaxtier/examples/data.py): the default corpus, text and token
files, their errors, and the batches drawn from them."""

import numpy as np
import pytest

from jaxtier.examples import data, tokenizer


def test_default_corpus_files_sorted_stdlib():
  files = data.default_corpus_files()
  assert len(files) > 100
  assert all(f.suffix == ".py" for f in files)
  assert not any("site-packages" in f.parts for f in files)
  assert files == data.default_corpus_files()


def test_load_text_and_token_files(tmp_path):
  text = tmp_path / "a.txt"
  text.write_text("héllo", encoding="utf-8")
  tokens = data.load_tokens([text])
  assert tokens.dtype == np.uint16
  assert bytes(tokens.astype(np.uint8)) == "héllo".encode("utf-8")
  token_file = tmp_path / "t.u16"
  np.array([1, 2, 300], "<u2").tofile(token_file)
  np.testing.assert_array_equal(data.load_tokens([token_file], vocab_size=512),
                                [1, 2, 300])
  assert data.load_tokens([text, text], max_bytes=8).size == 8


def test_load_errors(tmp_path):
  empty = tmp_path / "empty.txt"
  empty.write_bytes(b"")
  with pytest.raises(ValueError, match="empty.txt"):
    data.load_tokens([empty])
  with pytest.raises(ValueError, match=r"at least one path \(--data\), got none"):
    data.load_tokens([])
  odd = tmp_path / "odd.bin"
  odd.write_bytes(b"abc")
  with pytest.raises(ValueError, match=r"odd\.bin.*3 bytes"):
    data.load_tokens([odd])
  big = tmp_path / "big.u16"
  np.array([5, 256], "<u2").tofile(big)
  with pytest.raises(ValueError, match=r"big\.u16.*256"):
    data.load_tokens([big], vocab_size=256)
  with pytest.raises(ValueError, match=r"load_tokens: cannot read the data file .*missing\.txt' "
                     r"\(no such file\); pass --data as comma-separated text files"):
    data.load_tokens([tmp_path / "missing.txt"])
  with pytest.raises(ValueError, match=r"cannot read the data file .* \(it is a directory\)"):
    data.load_tokens([tmp_path])
  with pytest.raises(ValueError, match=r"load_texts: cannot read .*missing\.txt' \(no such"):
    data.load_texts([tmp_path / "missing.txt"])
  with pytest.raises(ValueError, match=r"--tokenizer=bpe: cannot read the data file "
                     r".*missing\.txt' \(no such file\)"):
    tokenizer.load_bpe(str(tmp_path / "missing.txt"), 32768, cache_dir=tmp_path / "cache")


def test_batches(corpus):
  with pytest.raises(ValueError, match="at least seq_len \\+ 1 = 11"):
    data.batches(np.arange(10, dtype=np.uint16), 2, 10, seed=0)
  it_a = data.batches(corpus, 3, 16, seed=5)
  it_b = data.batches(corpus, 3, 16, seed=5)
  for _ in range(3):
    a, b = next(it_a), next(it_b)
    assert a.shape == (3, 17) and a.dtype == np.int32
    np.testing.assert_array_equal(a, b)
  tokens = np.arange(20, dtype=np.uint16)
  batch = next(data.batches(tokens, 4, 19, seed=0))
  np.testing.assert_array_equal(batch, np.tile(np.arange(20), (4, 1)))


def test_a_file_that_is_not_text_is_refused_where_text_is_required(tmp_path):
  from jaxtier.examples import data as data_lib
  good = tmp_path / "a.txt"
  good.write_text("héllo wörld\n")
  bad = tmp_path / "b.txt"
  bad.write_bytes(b"text, then \xff\xfe binary")
  assert data_lib.load_corpus(str(good)).size == len("héllo wörld\n".encode())
  with pytest.raises(ValueError, match=r"'.*b\.txt' is not UTF-8 text \(byte 11 of 20 is 0xff\)"):
    data_lib.load_corpus(f"{good},{bad}")
  nul = tmp_path / "c.txt"
  nul.write_bytes(b"ab\0cd")
  with pytest.raises(ValueError, match=r"byte 2 of 5 is 0x00"):
    data_lib.load_corpus(str(nul))
  # The library's own reader takes any bytes unless asked for text.
  assert data_lib.load_tokens([bad]).size == 20


def test_a_corpus_small_for_the_run_is_named_with_its_sizes():
  assert data.corpus_size_warning(200_000, batch_size=8, seq_len=32, steps=20) is None
  assert data.corpus_size_warning(1000, batch_size=8, seq_len=256, steps=3) == (
      "the corpus is 1,000 tokens, fewer than one step's batch of 2,056 tokens (8 x 257): 3 "
      "steps read it 6.2 times over; use more --data, or fewer --steps, a smaller --batch_size "
      "or --seq_len")
  assert data.corpus_size_warning(5000, batch_size=8, seq_len=32, steps=200) == (
      "the corpus is 5,000 tokens, 200 steps of 264 tokens (8 x 33) read it 10.6 times over, "
      "more than 10; use more --data, or fewer --steps, a smaller --batch_size or --seq_len")
  # Ten passes are not yet too many.
  assert data.corpus_size_warning(5280, batch_size=8, seq_len=32, steps=200) is None
