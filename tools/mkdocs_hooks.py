# SPDX-License-Identifier: Apache-2.0
"""MkDocs hooks of the documentation site (``hooks:`` in ``mkdocs.yml``).

* Pages holding a ``<!-- generated: config-reference -->`` or
  ``<!-- generated: metrics-reference -->`` marker get the tables
  :mod:`gen_config_docs` renders from the code at build time, so the
  configuration and metrics references cannot drift from the code.
* The benchmark and reliability reports are written by other tools
  (``nox -s bench`` renders ``docs/benchmarks.md``); until a report exists, the
  site shows a page saying it is pending instead of a broken link.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gen_config_docs

logger = logging.getLogger("mkdocs.hooks.vllm_ascend_kv")

MARKERS = {
    "<!-- generated: config-reference -->": gen_config_docs.render_config,
    "<!-- generated: metrics-reference -->": gen_config_docs.render_metrics,
}

#: Reports other tools write into docs/, and what the site says until they exist.
PENDING_REPORTS = {
    "benchmarks.md": ("Benchmark report",
                      "`nox -s bench` runs every benchmark in a fixed configuration and renders "
                      "this page (`docs/benchmarks.md`) with its plots."),
    "reliability.md": ("Reliability report",
                       "The fault-injection and fuzzing report of the connectors will be written "
                       "to this page (`docs/reliability.md`)."),
}


def on_config(config: Any) -> Any:
    """Every package's ``src`` on ``sys.path``, for the generated references."""
    gen_config_docs.use_sources()
    return config


def on_files(files: Any, config: Any) -> Any:
    """A placeholder page for each report not written yet."""
    from mkdocs.structure.files import File

    for name, (title, how) in PENDING_REPORTS.items():
        if files.get_file_from_path(name) is not None:
            continue
        logger.info("%s not written yet: the site shows it as pending", name)
        content = (f"# {title}\n\n!!! note \"Pending\"\n    This report has not been "
                   f"generated in this checkout yet. {how}\n")
        files.append(File.generated(config, name, content=content))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace the generated-reference markers with the tables rendered from the code."""
    for marker, render in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown
