"""The figures cache: compiled memory figures kept on disk, keyed by the program and the
compiler, read back whole or not at all."""

import json
import logging
import os

import jax
import jax.numpy as jnp

from jaxtier._src.analysis import figures_cache
from jaxtier._src.analysis import step_costs


def _figures():
  lowered = jax.jit(lambda x: (x @ x.T).sum(0)).lower(jnp.ones((64, 32), jnp.float32))
  return lowered.as_text(), step_costs.memory_figures(lowered.compile())


def test_figures_stored_are_read_back_equal():
  text, fig = _figures()
  digest = figures_cache.key(text, backend="cpu")
  assert figures_cache.load(digest, step_costs.MemoryFigures) is None  # a miss
  figures_cache.store(digest, fig)
  assert figures_cache.load(digest, step_costs.MemoryFigures) == fig
  assert fig.peak_bytes > 0


def test_the_key_names_the_program_the_options_and_xla_flags(monkeypatch):
  text, _ = _figures()
  base = figures_cache.key(text, backend="cpu")
  assert base == figures_cache.key(text, backend="cpu")
  assert base != figures_cache.key(text + " ", backend="cpu")
  assert base != figures_cache.key(text, backend="cpu",
                                   options={"xla_backend_optimization_level": 0})
  assert base != figures_cache.key(text, backend="cpu", extra=("1024",))
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
  assert base != figures_cache.key(text, backend="cpu")


def test_a_damaged_or_foreign_entry_is_a_miss(monkeypatch):
  text, fig = _figures()
  digest = figures_cache.key(text, backend="cpu")
  figures_cache.store(digest, fig)
  path = os.path.join(figures_cache.directory(), f"{digest}.json")
  with open(path) as f:
    record = json.load(f)
  for damaged in ("{not json", json.dumps({**record, "format_version": 0}),
                  json.dumps({**record, "figures": {**record["figures"], "temp_bytes": "7"}}),
                  json.dumps({"format_version": figures_cache.FORMAT_VERSION,
                              "figures": {"peak_bytes": 1}})):
    with open(path, "w") as f:
      f.write(damaged)
    assert figures_cache.load(digest, step_costs.MemoryFigures) is None, damaged


def test_turned_off_it_stores_and_reads_nothing(monkeypatch, tmp_path):
  text, fig = _figures()
  digest = figures_cache.key(text, backend="cpu")
  monkeypatch.setenv("JAXTIER_FIGURES_CACHE", "0")
  assert figures_cache.directory() is None
  figures_cache.store(digest, fig)
  assert figures_cache.load(digest, step_costs.MemoryFigures) is None
  monkeypatch.setenv("JAXTIER_FIGURES_CACHE", str(tmp_path / "here"))
  assert figures_cache.load(digest, step_costs.MemoryFigures) is None
  figures_cache.store(digest, fig)
  assert os.listdir(tmp_path / "here") == [f"{digest}.json"]


def test_the_oldest_entries_go_beyond_the_limit(monkeypatch):
  text, fig = _figures()
  monkeypatch.setattr(figures_cache, "MAX_ENTRIES", 3)
  digests = [figures_cache.key(text, backend="cpu", extra=(str(i),)) for i in range(5)]
  for i, digest in enumerate(digests):
    figures_cache.store(digest, fig)
    path = os.path.join(figures_cache.directory(), f"{digest}.json")
    os.utime(path, (1000 + i, 1000 + i))
  figures_cache._prune(figures_cache.directory())  # pylint: disable=protected-access
  kept = sorted(n[:-5] for n in os.listdir(figures_cache.directory()))
  assert kept == sorted(digests[2:]), kept


def test_an_unwritable_folder_is_said_once_and_loses_nothing(monkeypatch, tmp_path, caplog):
  text, fig = _figures()
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  monkeypatch.setenv("JAXTIER_FIGURES_CACHE", str(blocker / "figures"))
  monkeypatch.setattr(figures_cache, "_WARNED", set())
  with caplog.at_level(logging.WARNING, logger="jaxtier"):
    for i in range(3):
      figures_cache.store(figures_cache.key(text, backend="cpu", extra=(str(i),)), fig)
  said = [r.getMessage() for r in caplog.records]
  assert said == [f"jaxtier: cannot write the figures cache at {blocker / 'figures'} (Not a "
                  "directory): a later process will compile what it could have read; set "
                  "JAXTIER_FIGURES_CACHE to a writable folder, or to 0"], said
  assert figures_cache.load(figures_cache.key(text, backend="cpu", extra=("0",)),
                            step_costs.MemoryFigures) is None
