"""Sphinx configuration of fastload's documentation site (``make docs``; ``make test`` builds it
with warnings as errors)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fastload  # noqa: E402

project = "fastload"
author = "fastload developers"
copyright = "fastload developers"  # noqa: A001
release = fastload.__version__

extensions = [
    "myst_parser",  # the pages are Markdown (CommonMark + tables)
    "sphinx.ext.autodoc",  # the API reference, from the docstrings
    "sphinx.ext.napoleon",  # ... which are Google style
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "README.md"]
myst_heading_anchors = 3  # links such as (swap.md#which-path) resolve to the page's headings
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_mock_imports = ["nvidia"]  # DALI is optional and imported lazily anyway
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_attr_annotations = True
napoleon_use_ivar = True  # "Attributes:" as fields: no second entry beside a property of that name
suppress_warnings = ["myst.header"]  # the pages keep the README's heading depths

html_theme = "furo"
html_title = f"fastload {release}"
html_static_path: list[str] = []
