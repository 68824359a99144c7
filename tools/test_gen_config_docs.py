# SPDX-License-Identifier: Apache-2.0
"""The generated references of the docs (run by ``nox -s docs`` before the build).

Every key of every configuration section and every declared metric appears; a key without
documentation and a metrics module the reference does not list fail the build; the MkDocs
hook fills the markers and stands in for reports not written yet.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gen_config_docs as gen

gen.use_sources()  # the packages' src folders, as the docs build sees them


def test_every_key_of_every_installed_connector_is_documented() -> None:
    sections = gen.config_sections()
    # core's own P/D sections and the pool and offload sections from the packages' entry points
    assert {"MooncakeConnectorV1", "MooncakeLayerwiseConnector", "AscendStoreConnector",
            "CPUOffloadingConnector"} <= set(sections)
    text = gen.render_config()
    for ref in [*sections.values(), *gen.EXTRA_SECTIONS.values()]:
        cls = gen._load(ref)
        keys = [d.key for d in cls.describe()]
        assert keys, ref
        for key in keys:
            assert f"| `{key}` |" in text, (ref, key)
    assert "| `local_pool_size` | `size (int bytes or '1.5GB')` | `8GB` |" in text
    assert "Deprecated spelling: `mooncake_rpc_port`" in text
    # a pipe inside a code span stays in its cell
    assert "| `backend` | `'local' | 'mooncake' | 'memcache'` | `'local'` |" in text


def test_a_key_without_documentation_fails_the_build() -> None:
    from vllm_ascend.distributed.kv_transfer.core.config import ConfigSection, option

    @dataclass(frozen=True)
    class Undocumented(ConfigSection):
        """A section with a key nobody explained."""

        mystery: int = option(1, doc="  ")

    with pytest.raises(ValueError, match="key 'mystery' has no documentation"):
        gen.render_section("x", Undocumented)


def test_every_declared_metric_is_listed_with_its_prometheus_name() -> None:
    text = gen.render_metrics()
    for source in gen.METRIC_SOURCES:
        for spec in gen._load(source.ref):
            series = {"counter": f"`{spec.prom_name}_total`",
                      "histogram": f"`{spec.prom_name}_bucket`",
                      "gauge": f"`{spec.prom_name}`"}[spec.kind]
            assert f"| {series}" in text, spec.name
    assert "| `vllm:ascend_kv_p2p_failures_total` | counter | `cause` |" in text
    assert "Buckets: 1 KiB … 4 GiB." in text


def test_a_metrics_module_missing_from_the_reference_fails_the_build(tmp_path: Path) -> None:
    pkg = tmp_path / "packages" / "new-connector" / "src" / "vllm_ascend" / "x"
    pkg.mkdir(parents=True)
    (pkg / "new_metrics.py").write_text('M = [MetricSpec("x", "counter", "doc")]\n')
    with pytest.raises(ValueError, match="new_metrics.py declares MetricSpec entries"):
        gen.check_metric_sources(tmp_path)
    gen.check_metric_sources(tmp_path, (gen.MetricSource("t", "d", "vllm_ascend.x.new_metrics:M",
                                                         ""),))


def test_hook_fills_markers_and_stands_in_for_missing_reports(tmp_path: Path) -> None:
    """A real (small) MkDocs build with the hooks: markers replaced, a pending report added."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Ref\n\n<!-- generated: metrics-reference -->\n")
    (docs / "benchmarks.md").write_text("# Benchmarks\n\nreal numbers\n")
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: t\nstrict: true\nhooks:\n"
        f"  - {Path(__file__).resolve().parent / 'mkdocs_hooks.py'}\n"
        "markdown_extensions: [admonition, tables]\n"
        "nav: [index.md, benchmarks.md, reliability.md]\n")
    build(load_config(str(tmp_path / "mkdocs.yml")))
    site = tmp_path / "site"
    index = (site / "index.html").read_text()
    assert "generated: metrics-reference" not in index
    assert "vllm:ascend_kv_pool_hit_tokens_total" in index
    assert "real numbers" in (site / "benchmarks" / "index.html").read_text()
    assert "Pending" in (site / "reliability" / "index.html").read_text()
