"""The `--help` text of `python -m jaxtier` and of each of its commands, at the terminal's width.

Every command's help has one form (`render`): its usage line, what it does, and the flags it
reads as absl writes them (`FlagValues.get_help`), each flag's help said as it applies to that
command (`with_help`). `print_help` prints it. A bad command line is said in one line that
names that help (`bad_command_line`).
"""

from __future__ import annotations

import copy
import os
import re
import sys
import textwrap
from typing import Any, Mapping, NoReturn, Sequence

from absl import flags

# A row of a table: an indented name, two spaces or more, then its text (wrapped under it).
_ROW = re.compile(r"^(\s+\S+\s{2,})\S")


def fit(text: str, width: "int | None" = None) -> str:
  """`text` reflowed to `width` columns (default: the terminal's, as absl wraps its flags'
  help). Paragraphs are separated by blank lines; each is joined and wrapped, but a paragraph
  of table rows (`  name   what it is`) keeps a line per row, its text wrapped under the
  column where it starts. Words are never broken."""
  width = width or flags.get_help_width()
  out = []
  for paragraph in text.strip("\n").split("\n\n"):
    lines = paragraph.split("\n")
    if all(_ROW.match(l) for l in lines[1:]) and len(lines) > 1 and not _ROW.match(lines[0]):
      # A heading, then its rows.
      out.append("\n".join([_wrap(lines[0], width, "")]
                           + [_wrap(l, width, " " * len(_ROW.match(l).group(1)))
                              for l in lines[1:]]))
    elif all(_ROW.match(l) for l in lines):
      out.append("\n".join(_wrap(l, width, " " * len(_ROW.match(l).group(1))) for l in lines))
    else:
      indent = re.match(r"\s*", lines[0]).group(0)
      out.append(_wrap(" ".join(l.strip() for l in lines), width, indent, indent))
  return "\n\n".join(out)


def _wrap(line: str, width: int, subsequent: str, first: str = "") -> str:
  return "\n".join(textwrap.wrap(line.strip() if first else line, width, initial_indent=first,
                                 subsequent_indent=subsequent, break_long_words=False,
                                 break_on_hyphens=False)) or line


def say(text: str, width: "int | None" = None) -> None:
  """Prints `text` (an error, a note, the fixes) to stderr, each of its lines wrapped to `width`
  columns (default: the terminal's) with its continuation indented by two spaces."""
  width = width or flags.get_help_width()
  print("\n".join(_wrap(line, width, "  ") for line in text.split("\n")), file=sys.stderr)


def with_help(flag: Any, help_text: "str | None" = None, *, show_default: bool = True) -> Any:
  """`flag` as a command's help shows it: a copy with `help_text` for its help (where given;
  an enum's values, `<a|b>: `, still first), and without its default where `show_default` is
  False; the flag itself is not changed."""
  if help_text is None and show_default:
    return flag
  shown = copy.deepcopy(flag)
  if help_text is not None:
    values = re.match(r"<[^>]*>: ", flag.help or "")
    shown.help = (values.group(0) if values else "") + help_text
  if not show_default:
    shown.default_as_str = None
  return shown


def render(usage: str, about: str, shown: Sequence[Any], heading: str) -> str:
  """A command's help: `usage`, `about` (what it does) and the flags `shown` (absl's
  `FlagValues.get_help` of them) under `heading`, at the terminal's width."""
  values = flags.FlagValues()
  for flag in shown:
    values[flag.name] = flag
  usage = _wrap(usage, flags.get_help_width(), " " * len("usage: "))
  return (f"{usage}\n\n{fit(about)}\n\n{heading}\n"
          f"{values.get_help(include_special_flags=False)}")


def by_name(values: flags.FlagValues, names: Sequence[str],
            helps: "Mapping[str, str] | None" = None) -> list[Any]:
  """The flags `names` of `values`, each with its help in `helps` where it has one there."""
  helps = helps or {}
  return [with_help(values[name], helps.get(name)) for name in names]


def print_help(text: str) -> int:
  """Prints `text` (a --help) on stdout and returns the exit status: 0, or 1 where stdout is a
  pipe whose reader is gone (`--help | head -3`), without a BrokenPipeError traceback, as
  Python's docs advise (https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
  try:
    print(text)
    sys.stdout.flush()  # here, not in the interpreter's flush at exit, where it cannot be caught
  except BrokenPipeError:
    stdout_gone()
    return 1
  return 0


def stdout_gone() -> None:
  """Points stdout at the null device once its reader is gone (a BrokenPipeError): what it
  still holds goes nowhere, and the interpreter's flush at exit does not fail again."""
  os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# The command line whose commands the help lists.
PROGRAM = "python -m jaxtier"


def bad_command_line(command: "str | None", what: object,
                     program: str = PROGRAM) -> "NoReturn":
  """Says in one line on stderr what is wrong with the command line and where its flags are
  listed, then exits 2 (as argparse does for a usage error; absl exits 1, with many lines).

  Args:
    command: the command given (its --help is named), or None (the program's own --help is).
    what: what is wrong, e.g. absl's `flags.Error` ("Unknown command line flag 'nope'").
    program: how the program was run: `PROGRAM`, whose own --help lists the commands, or an
      entry point of its own whose --help lists its flags (the example trainer's).
  """
  said = " ".join(str(what).removeprefix("jaxtier: ").split()).removesuffix(".")
  named = f"{program} {command}" if command else program
  listed = "the commands" if named == PROGRAM else "its flags"
  print(f"{named}: {said}; {named} --help lists {listed}", file=sys.stderr)
  sys.exit(2)


def parse_flags(argv: "list[str]", command: "str | None" = None,
                program: str = PROGRAM) -> "list[str]":
  """`app.run`'s flags parser: absl's (`FlagValues.__call__`), a bad flag said in one line by
  `bad_command_line` (naming `command`, the command given, of `program`) rather than absl's
  'FATAL Flags parsing error' and exit status 1."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    # A check of several flags names them itself: absl's 'flags a=1, b=2: ' before it is not
    # said.
    said = re.sub(r"^flags (\w+=[^,:]*, )*\w+=[^,:]*: (?=.*--)", "", str(e))
    bad_command_line(command, said, program)
