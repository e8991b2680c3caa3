"""Sphinx configuration of the smoothing_jax documentation.

Build (offline, executes nothing, warnings are errors):

    pip install -r requirements-docs.txt -e .      # or: pip install -e .[docs]
    sphinx-build -W --keep-going -b html docs docs/_build/html

Pages are Markdown (MyST) rendered by myst-nb, which also renders the notebooks of ``colabs/``;
the API reference is autodoc + autosummary over the installed ``smoothing_jax`` package.
"""
from __future__ import annotations

import importlib.util
import io
import os
import pathlib
import re
import shutil
import sys

# autodoc imports the package, and TensorFlow with it: keep its start-up lines out of the log.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from docutils import nodes as _nodes
from docutils.core import publish_doctree as _publish_doctree
from sphinx.transforms.post_transforms import SphinxPostTransform

DOCS = pathlib.Path(__file__).resolve().parent
REPO = DOCS.parent

# The package is normally installed (``pip install -e .``); a plain checkout works too.
sys.path.insert(0, str(REPO))

# ---------------------------------------------------------------------------------------------
# The notebooks.
#
# ``colabs/*.ipynb`` is the one copy of the notebooks (the tests run them, Colab opens them from
# there).  Sphinx only reads documents inside its source folder, so at every build, before Sphinx
# looks for documents, this file mirrors ``colabs/*.ipynb`` into ``docs/notebooks/`` (git-ignored):
# a notebook that is new or changed is copied (``copy2`` keeps its modification time, so Sphinx's
# incremental builds see exactly which changed), one that left ``colabs/`` is removed.  This was
# chosen over the alternatives:
#   * symbolic links: break on checkouts without symlink support (Windows) and in some packagers;
#   * ``nbsphinx_link``-style ``.nblink`` files: an nbsphinx feature that myst-nb does not read;
#   * ``{include}`` of a notebook from a Markdown page: includes text, not a notebook's cells and
#     outputs.
# The copies are never edited by hand; ``docs/notebooks.md`` holds their toctree.  The notebooks
# are rendered as stored (``nb_execution_mode = "off"``): without outputs today, with them once
# they are committed executed.
# ---------------------------------------------------------------------------------------------
NOTEBOOK_SOURCE = REPO / "colabs"
NOTEBOOK_COPIES = DOCS / "notebooks"


def sync_notebooks(source: pathlib.Path = NOTEBOOK_SOURCE,
                   target: pathlib.Path = NOTEBOOK_COPIES) -> list:
  """Mirror ``source/*.ipynb`` into ``target``; returns the notebook names, sorted."""
  target.mkdir(exist_ok=True)
  wanted = {path.name: path for path in source.glob("*.ipynb")}
  for stale in target.glob("*.ipynb"):
    if stale.name not in wanted:
      stale.unlink()
  for name, path in wanted.items():
    copy = target / name
    if not copy.exists() or copy.read_bytes() != path.read_bytes():
      shutil.copy2(path, copy)
  return sorted(wanted)


NOTEBOOKS = sync_notebooks()

# -- Project -----------------------------------------------------------------------------------
project = "smoothing_jax"
author = "smoothing_jax authors"
copyright = "the smoothing_jax authors"
try:
  from importlib.metadata import version as _version
  release = _version("smoothing_jax")
except Exception:  # not installed: read by path only
  release = "0.1.0"
version = release

# -- Extensions --------------------------------------------------------------------------------
extensions = [
    "myst_nb",  # Markdown pages (it brings myst_parser) and notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx.ext.mathjax",
]
# No intersphinx: the build must not reach the network.

# ".rst" first: autosummary writes its generated stubs (reStructuredText) with the first suffix
# whose parser reads reStructuredText.
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]

# -- MyST / myst-nb ----------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath", "amsmath", "attrs_block"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links to headings down to ###
nb_execution_mode = "off"  # the docs build executes nothing: notebooks render as committed
nb_merge_streams = True  # one block per stream of a cell's output, once they hold outputs

# -- autodoc / autosummary / napoleon ----------------------------------------------------------
autosummary_generate = True  # stub pages under api/_autosummary/ (git-ignored), every build
autosummary_imported_members = False  # a re-export is documented where it is defined
autosummary_ignore_module_all = True
autodoc_default_options = {
    "members": True,
    "member-order": "bysource",
    # Packages re-export their submodules' names in ``__all__``; document each object once, in
    # the module that defines it (its page is linked from the package's).
    "ignore-module-all": True,
}
# The tf.data path and the TFDS builders (``data.tfdata``, ``augment``, ``randaugment``, ``camvid``,
# ``cifar100_corrupted``) import TensorFlow at import time; where it is not installed (e.g. the
# accelerator image's venv, ``experiments/accelerator_env.sh``) autodoc reads them against mocks.
# ``SMOOTHING_JAX_DOCS_MOCK_TF=1`` forces the mocks (to check that this still builds cleanly).
autodoc_mock_imports = [
    name for name in ("tensorflow", "tensorflow_datasets")
    if os.environ.get("SMOOTHING_JAX_DOCS_MOCK_TF") or importlib.util.find_spec(name) is None]
autodoc_typehints = "signature"  # annotations stay in the signature: docstrings are prose
autodoc_docstring_signature = True
autodoc_preserve_defaults = True  # ``sizes=()`` rather than the evaluated default
autodoc_inherit_docstrings = False  # a Flax module's __call__ does not repeat nn.Module's
autoclass_content = "class"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# "Attributes:" sections as an ``:ivar:`` field list: as ``.. attribute::`` entries they would
# describe a Flax module's fields a second time beside autodoc's (duplicate object warnings).
napoleon_use_ivar = True

# Warnings silenced on purpose (each a category, not a blanket):
suppress_warnings = [
    # Executed notebooks may hold widget outputs (progress bars) that have no static rendering.
    "mystnb.unknown_mime_type",
]

# -- Docstrings written as plain text ---------------------------------------------------------
#
# The package's docstrings are reStructuredText-ish prose: ``literals``, :func:`roles`, bullets,
# and mathematics in Unicode.  Two habits of that prose are not valid reStructuredText, and this
# file repairs them at build time rather than the docstrings being rewritten for Sphinx:
#
# 1. ``|λ|``, ``|θ|``: absolute values read as substitution references ("Undefined substitution
#    referenced").  Every ``|`` outside a ``literal`` and a ``::`` block is escaped (``\|``), which
#    renders as ``|``.
# 2. Plain-text layout (a list or an aligned table indented under a paragraph without a blank
#    line, e.g. ``smoothing_jax.main``'s modes): "Unexpected indentation" and friends.  Each
#    docstring is parsed once with docutils; if the parse reports one of those structural
#    problems, the docstring is shown as written, in a literal block, instead of as mangled
#    markup.  ``DOCSTRINGS_SHOWN_AS_TEXT`` collects their names (printed at the end of a build)
#    so that they can be fixed at the source one day.
_STRUCTURAL_PROBLEMS = (
    "Unexpected indentation",
    "ends without a blank line",
    "Unexpected section title",
    "Inconsistent literal block quoting",
    "start-string without end-string",
    "Malformed table",
    "Enumerated list start value not ordinal",
)
_LITERAL = re.compile(r"(``.+?``)")
_ROLE = re.compile(r":[\w:.+-]+:`([^`]*)`")
DOCSTRINGS_SHOWN_AS_TEXT: list = []


def _escape_bars(line: str) -> str:
  """``|`` outside ``literals`` escaped, so that ``|x|`` is not a substitution reference."""
  parts = _LITERAL.split(line)
  return "".join(part if i % 2 else part.replace("|", "\\|") for i, part in enumerate(parts))


def _structural_problems(text: str) -> list:
  """The structural docutils messages of ``text`` parsed alone.  Roles are replaced by literals
  first: Sphinx's roles need a build environment, and an unknown role is not a layout problem."""
  text = _ROLE.sub(r"``\1``", text)
  settings = {"report_level": 5, "halt_level": 5, "warning_stream": io.StringIO(),
              "file_insertion_enabled": False, "raw_enabled": False}
  try:
    doctree = _publish_doctree(text, settings_overrides=settings)
  except Exception:  # a directive that needs Sphinx: leave the docstring to Sphinx
    return []
  return [message.astext() for message in doctree.findall(_nodes.system_message)
          if message["level"] >= 2 and any(p in message.astext() for p in _STRUCTURAL_PROBLEMS)]


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def _escape_bars_outside_literal_blocks(lines: list) -> list:
  """:func:`_escape_bars` on every line but those of ``::`` literal blocks (shown verbatim)."""
  out, block_indent = [], None  # indentation of the line that opened a literal block
  for line in lines:
    if block_indent is not None and line.strip() and _indent(line) <= block_indent:
      block_indent = None
    out.append(line if block_indent is not None else _escape_bars(line))
    if block_indent is None and line.rstrip().endswith("::"):
      block_indent = _indent(line)
  return out


def _process_docstring(app, what, name, obj, options, lines):
  if not lines:
    return
  escaped = _escape_bars_outside_literal_blocks(lines)
  if _structural_problems("\n".join(escaped)):
    DOCSTRINGS_SHOWN_AS_TEXT.append(name)
    escaped = ["::", ""] + ["   " + line if line.strip() else "" for line in lines]
  lines[:] = escaped


def _report_text_docstrings(app, exception):
  if DOCSTRINGS_SHOWN_AS_TEXT:
    names = sorted(set(DOCSTRINGS_SHOWN_AS_TEXT))
    print(f"Docstrings shown as literal text (not valid reStructuredText): {', '.join(names)}")


# -- Inline code in tables breaks at dots, never inside a word ------------------------------------
#
# Settings keys (``input.dataset``) and file lists (``ensemble_sizes.{json,csv,png}``) in narrow
# table cells must wrap, but CSS alone can only break anywhere (``overflow-wrap: anywhere`` gave
# ``input.d ataset``) or nowhere.  This transform puts a ``<wbr>`` (a break opportunity that is not
# copied with the text) after every ``.``, ``/`` and ``,`` that follows a letter or digit and
# precedes a letter, ``_``, ``<``, ``{`` or ``*`` (so not inside a number, ``0.0``, nor after the
# leading dot of ``.vmap_size``) in a literal that sits in a table; ``_static/custom.css`` keeps
# every other position unbreakable.
_BREAK_AFTER = re.compile(r"(?<=\w[./,])(?=[A-Za-z_<{*])")


class _TableLiteralBreaks(SphinxPostTransform):
  default_priority = 900
  formats = ("html",)

  def run(self, **kwargs):
    for table in self.document.findall(_nodes.table):
      for literal in list(table.findall(_nodes.literal)):
        for text in list(literal.findall(_nodes.Text)):
          pieces = _BREAK_AFTER.split(str(text))
          if len(pieces) == 1:
            continue
          new = []
          for i, piece in enumerate(pieces):
            if i:
              new.append(_nodes.raw("", "<wbr>", format="html"))
            new.append(_nodes.Text(piece))
          text.parent.replace(text, new)


def setup(app):
  # After napoleon (priority 500), which turns "Args:" sections into field lists first.
  app.connect("autodoc-process-docstring", _process_docstring, priority=600)
  app.connect("build-finished", _report_text_docstrings)
  app.add_post_transform(_TableLiteralBreaks)


# -- HTML --------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "smoothing_jax"
html_theme_options = {
    # One search box, the sidebar's (the theme's header would show a second one).
    "navbar_persistent": [],
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "use_download_button": True,
    "use_fullscreen_button": False,
    "navigation_with_keys": False,
}
html_static_path = ["_static"]
html_css_files = ["custom.css"]
