# SPDX-License-Identifier: Apache-2.0
"""One module per benchmark of the report (``<bench>.py`` renders ``<bench>.json``).

Each module defines ``SECTION`` (see ``_common.Section``); ``benchmarks/render.py`` loads
them as the package ``bench_sections`` from this folder.
"""
