"""The example tests' shared corpus: the first 40 files of the default corpus, 200 kB."""

import pytest

from jaxtier.examples import data


@pytest.fixture(scope="module")
def corpus():
  files = data.default_corpus_files()
  return data.load_tokens(files[:40], max_bytes=200_000)
