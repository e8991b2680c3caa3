"""The documentation's code fits its column: text only, nothing is built or run.

``CODE_COLUMNS`` is the width of a code block of the built docs (sphinx-book-theme) in a
1280 px wide window, measured in headless Chromium: a block's content box is 644 px (a
notebook cell's 640 px) and a character of its 14 px monospace font (DejaVu Sans Mono, the
fallback of the theme's font stack on Linux; Menlo has the same advance) is 8.43 px, so 76
characters fit in a Markdown code block and 75 in a notebook cell.  A longer line is cut at
the edge of the column and hides what ends it (the flag that matters, most often).
"""
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CODE_COLUMNS = 75

# An opening fence: ``` or ~~~ (three or more), then a language or a MyST directive name.
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(\S*)")
# MyST directives in fences that are code (the others: figures, toctrees, notes, ...).
_CODE_DIRECTIVES = {"{code}", "{code-block}", "{code-cell}", "{sourcecode}"}


def markdown_code_lines(text: str):
  """(line number, line) of every line inside a fenced code block of Markdown ``text``."""
  fence = None  # (fence characters, whether the block is code)
  for number, line in enumerate(text.splitlines(), start=1):
    if fence is None:
      match = _FENCE.match(line)
      if match:
        lang = match.group(2)
        fence = (match.group(1), not lang.startswith("{") or lang in _CODE_DIRECTIVES)
      continue
    stripped = line.strip()
    if stripped and set(stripped) == {fence[0][0]} and len(stripped) >= len(fence[0]):
      fence = None
    elif fence[1]:
      yield number, line


def notebook_code_lines(path: pathlib.Path):
  """(cell index:line number, line) of every line of a notebook's code cells and of the fenced
  code blocks of its Markdown cells (its stored sources; outputs are not read)."""
  for index, cell in enumerate(json.loads(path.read_text())["cells"]):
    source = "".join(cell["source"])
    if cell["cell_type"] == "code":
      lines = enumerate(source.splitlines(), start=1)
    elif cell["cell_type"] == "markdown":
      lines = markdown_code_lines(source)
    else:
      continue
    for number, line in lines:
      yield f"cell {index}:{number}", line


def _documents():
  built = DOCS / "_build"
  for path in sorted(DOCS.rglob("*.md")):
    if built not in path.parents and "_autosummary" not in path.parts:
      yield path, markdown_code_lines(path.read_text())
  colabs = sorted((ROOT / "colabs").glob("*.ipynb"))
  yield from ((path, notebook_code_lines(path)) for path in colabs)
  # docs/notebooks/ mirrors colabs/ at build time (git-ignored copies, stale between builds):
  # only a notebook of the docs' own is read there.
  mirrored = {DOCS / "notebooks" / path.name for path in colabs}
  for path in sorted(DOCS.rglob("*.ipynb")):
    if (built not in path.parents and ".ipynb_checkpoints" not in path.parts
        and path not in mirrored):
      yield path, notebook_code_lines(path)


def test_markdown_code_blocks_are_found():
  text = ("x\n```bash\nrun \\\n  --flag\n```\n```{toctree}\nnot code\n```\n"
          "  ````python\n  a = 1\n  ```\n  ````\n")
  assert list(markdown_code_lines(text)) == [(3, "run \\"), (4, "  --flag"), (10, "  a = 1"),
                                             (11, "  ```")]


def test_no_code_line_is_wider_than_the_docs_column():
  too_wide = [f"{path.relative_to(ROOT)}:{where}: {len(line)} characters"
              for path, lines in _documents() for where, line in lines
              if len(line) > CODE_COLUMNS]
  assert not too_wide, (
      f"code lines wider than the docs' code column ({CODE_COLUMNS} characters at 1280 px; "
      "wrap commands with '\\' continuations):\n" + "\n".join(too_wide))
