"""Output paths checked before any work starts (`jaxtier/_src/paths.py`)."""

import os

from jaxtier._src import paths


def test_a_folder_that_is_a_file_or_under_one_is_unwritable_and_a_new_one_is_not(tmp_path):
  (tmp_path / "a_file").write_text("")
  assert paths.why_unwritable_folder(str(tmp_path / "a_file")) == (
      f"{str(tmp_path / 'a_file')!r} is a file, not a folder; name a folder")
  under = str(tmp_path / "a_file" / "run")
  assert paths.why_unwritable_folder(under) == (
      f"{under!r} cannot be made: {tmp_path / 'a_file'} is a file")
  # A folder to be made two levels down, and one that exists: nothing wrong, nothing made.
  assert paths.why_unwritable_folder(str(tmp_path / "new" / "run")) is None
  assert paths.why_unwritable_folder(str(tmp_path)) is None
  assert not (tmp_path / "new").exists()
  assert sorted(os.listdir(tmp_path)) == ["a_file"]


def test_a_folder_no_write_reaches_is_unwritable():
  # /proc refuses a file whatever the permission bits say (root included).
  said = paths.why_unwritable_folder("/proc/jaxtier-run")
  assert said is not None and said.startswith("'/proc/jaxtier-run' cannot be written: /proc is "
                                               "not writable"), said
