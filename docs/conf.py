"""Sphinx configuration of the documentation site (``make docs``).

The pages are Markdown (MyST); the API reference is made by autodoc from the
docstrings of every public name (``api.md``). The build is strict: ``make docs`` runs
``sphinx-build -W --keep-going -n``, so a broken link, a missing reference or a
docstring that does not render fails it."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the source tree's package, installed or not

from flax_orbax_plugin import _version  # noqa: E402

project = "flax_orbax_plugin"
author = "flax_orbax_plugin authors"
copyright = "flax_orbax_plugin authors"
release = version = _version.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "wings", "README.md"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_typehints = "none"  # the signatures name the types; the docstrings say the rest
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
nitpicky = True

html_theme = "alabaster"
html_title = f"flax_orbax_plugin {release}"
