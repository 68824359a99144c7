# SPDX-License-Identifier: Apache-2.0
"""The results ledger: entries written and read back, sources and staleness, the latest-run
rule, where a run goes, and the difference bootstrap the goal rows use."""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.bench import ledger
from vllm_ascend.distributed.kv_transfer.bench.stats import compare_difference


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A git checkout shaped like this repository: benchmarks/render.py, two packages."""
    root = tmp_path / "repo"
    for pkg in ("ascend-kernels", "ascend-kv-core"):
        (root / "packages" / pkg / "src").mkdir(parents=True)
        (root / "packages" / pkg / "src" / "m.py").write_text(f"# {pkg}\n")
    (root / "benchmarks").mkdir()
    (root / "benchmarks" / "render.py").write_text("")
    _git(root.parent, "init", "-q", str(root))
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init")
    return root


def _entry(root: Path | None, section: str = "kernels", **kw: Any) -> dict[str, Any]:
    samples = [ledger.series({"block_kib": 64, "role": "kernel"}, [[1.0, 2.0], [3.0]])]
    return ledger.make_entry(section, {"benchmark": section, "x": 1.5}, samples,
                             {"rounds": 9}, root=root,
                             started={"time": "2026-12-06T10:00:00Z", "loadavg": [0.5]}, **kw)


def test_an_entry_round_trips_with_every_raw_sample(tmp_path: Path, checkout: Path) -> None:
    entry = _entry(checkout)
    path = ledger.append(tmp_path / "results", entry)
    assert path.parent == tmp_path / "results" / "kernels" and path.name.endswith(".json.gz")
    assert path.name.split("-")[-1] == f"{entry['source']['commit'][:9]}.json.gz"
    (back,) = ledger.read_entries(tmp_path / "results")
    assert back["id"] == f"kernels/{path.name[:-len('.json.gz')]}"
    assert back["samples"] == [{"tags": {"block_kib": 64, "role": "kernel"}, "unit": "s",
                                "rounds": [[1.0, 2.0], [3.0]]}]
    assert back["result"] == {"benchmark": "kernels", "x": 1.5}
    assert back["config"] == {"rounds": 9}
    m = back["machine"]
    assert m["loadavg_start"] == [0.5] and len(m["loadavg_end"]) == 3
    assert m["affinity"] and m["cpus"] >= 1 and m["mem_total_kib"] > 0
    assert {"ascend-kv-bench", "vllm", "mooncake", "torch"} <= set(back["versions"])
    # the bytes depend on the entry alone (no time in the gzip header)
    again = ledger.append(tmp_path / "other", entry)
    assert again.read_bytes() == path.read_bytes()
    assert json.loads(gzip.decompress(path.read_bytes()))["section"] == "kernels"


def test_the_ledger_is_append_only(tmp_path: Path) -> None:
    entry = _entry(None)
    first = ledger.append(tmp_path, entry)
    second = ledger.append(tmp_path, entry)  # the same second: a new file, the first kept
    assert first != second and first.exists() and second.exists()
    assert len(ledger.read_entries(tmp_path, "kernels")) == 2


def test_a_broken_or_newer_entry_is_refused(tmp_path: Path) -> None:
    (tmp_path / "p2p").mkdir()
    (tmp_path / "p2p" / "x.json.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="not a ledger entry"):
        ledger.read_entries(tmp_path)
    (tmp_path / "p2p" / "x.json.gz").write_bytes(gzip.compress(b'{"format": 99}'))
    with pytest.raises(ValueError, match="format"):
        ledger.read_entries(tmp_path)


def test_sources_and_staleness(checkout: Path) -> None:
    clean = _entry(checkout)
    src = clean["source"]
    assert src["commit"] == _git(checkout, "rev-parse", "HEAD") and src["dirty"] is False
    head = ledger.head_trees(checkout, ["ascend-kernels"])
    assert src["packages"] == head and not ledger.is_stale(clean, head)
    # an uncommitted edit of a measured package: dirty, and another tree than HEAD's
    (checkout / "packages" / "ascend-kernels" / "src" / "m.py").write_text("# edited\n")
    dirty = _entry(checkout)
    assert dirty["source"]["dirty"] is True and ledger.is_stale(dirty, head)
    assert _git(checkout, "status", "--porcelain")  # the repository's own index untouched
    assert "m.py" not in _git(checkout, "diff", "--cached", "--name-only")
    # committed as measured: the run is current at the new HEAD, the clean one is stale
    _git(checkout, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "edit")
    head = ledger.head_trees(checkout, ["ascend-kernels"])
    assert not ledger.is_stale(dirty, head) and ledger.is_stale(clean, head)
    # a commit elsewhere leaves it current; no recorded source is stale
    (checkout / "packages" / "ascend-kv-core" / "src" / "m.py").write_text("# other\n")
    _git(checkout, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "core")
    assert not ledger.is_stale(dirty, ledger.head_trees(checkout, ["ascend-kernels"]))
    assert ledger.is_stale(_entry(None), head)


def test_the_rendered_report_is_not_dirt(checkout: Path) -> None:
    """``nox -s bench`` renders the report after each invocation: a next invocation in the
    same checkout is not recorded dirty for it, for any other tracked change it is."""
    (checkout / "docs" / "img").mkdir(parents=True)
    (checkout / "docs" / "benchmarks.md").write_text("# page\n")
    (checkout / "docs" / "img" / "bench-serve.png").write_bytes(b"png")
    (checkout / "README.md").write_text("readme\n")
    _git(checkout, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(checkout, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "docs")
    (checkout / "docs" / "benchmarks.md").write_text("# rendered again\n")
    (checkout / "docs" / "img" / "bench-serve.png").write_bytes(b"png again")
    assert _entry(checkout)["source"]["dirty"] is False
    (checkout / "README.md").write_text("edited\n")
    assert _entry(checkout)["source"]["dirty"] is True


def test_a_source_edited_while_the_run_went_on_leaves_it_stale(checkout: Path) -> None:
    """The run measured the sources it started with: a measured package edited before it
    ended is recorded as changed, with no tree, and its entry is stale at any HEAD."""
    started = {"time": "2026-12-06T10:00:00Z", "loadavg": [0.5],
               "source": ledger.source_state(checkout, ledger.RUNTIME_PACKAGES)}
    (checkout / "packages" / "ascend-kernels" / "src" / "during.py").write_text("# mid-run\n")
    entry = ledger.make_entry("kernels", {}, [], {}, root=checkout, started=started)
    assert entry["source"]["changed_during_run"] == ["ascend-kernels"]
    assert entry["source"]["packages"] == {"ascend-kernels": None}
    _git(checkout, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(checkout, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "mid-run")
    assert ledger.is_stale(entry, ledger.head_trees(checkout, ["ascend-kernels"]))
    # untouched during the run: recorded as before
    again = ledger.make_entry("kernels", {}, [], {}, root=checkout, started={
        "source": ledger.source_state(checkout, ledger.RUNTIME_PACKAGES)})
    assert "changed_during_run" not in again["source"]
    assert not ledger.is_stale(again, ledger.head_trees(checkout, ["ascend-kernels"]))


def test_the_latest_run_with_the_rows_options() -> None:
    def e(ended: str, layers: int, value: float) -> dict[str, Any]:
        return {"section": "p2p", "ended": ended, "id": f"p2p/{ended}",
                "config": {"layers": layers}, "result": {"v": value}}

    runs = [e("2026-12-06T10:00:00Z", 8, 0.99), e("2026-12-06T12:00:00Z", 8, 0.5),
            e("2026-12-06T13:00:00Z", 64, 0.7)]
    assert ledger.latest(runs, "p2p")["result"]["v"] == 0.7
    assert ledger.latest(runs, "p2p", lambda x: x["config"]["layers"] == 8)["result"]["v"] == 0.5
    assert ledger.latest(runs, "kernels") is None


def test_the_source_of_an_installed_copy_is_the_working_directorys_checkout(
        tmp_path: Path, checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module run from a source tree is its own checkout's; an installed copy, even in a
    virtual environment inside a checkout (nox's .nox), is the working directory's (a
    worktree at the commit measured, run with that environment)."""
    source = checkout / "packages" / "ascend-kv-core" / "src"
    installed = checkout / ".nox" / "bench" / "lib" / "python3.11" / "site-packages" / "m"
    installed.mkdir(parents=True)
    worktree = tmp_path / "wt"
    (worktree / "packages").mkdir(parents=True)
    (worktree / "benchmarks").mkdir()
    (worktree / "benchmarks" / "render.py").write_text("")
    monkeypatch.chdir(worktree)
    assert ledger.source_root(source) == checkout
    assert ledger.source_root(installed) == worktree.resolve()
    monkeypatch.chdir(tmp_path)  # outside any checkout: no source
    assert ledger.source_root(installed) is None


def test_where_a_run_goes(tmp_path: Path, checkout: Path) -> None:
    def args(**kw: Any) -> argparse.Namespace:
        return argparse.Namespace(**{"ledger": None, "quick": False, **kw})

    assert ledger.ledger_dir(args(), cwd=checkout / "packages") == \
        checkout / "benchmarks" / "results"
    assert ledger.ledger_dir(args(quick=True), cwd=checkout) is None  # a smoke run
    assert ledger.ledger_dir(args(quick=True, ledger=str(tmp_path)), cwd=checkout) == tmp_path
    assert ledger.ledger_dir(args(ledger="none"), cwd=checkout) is None
    assert ledger.ledger_dir(args(), cwd=tmp_path) is None  # outside a checkout
    assert ledger.config_of(args(rounds=9, func=print, out="x")) == {"quick": False,
                                                                     "rounds": 9}


def test_the_difference_bootstrap() -> None:
    # a round slow for both sides cancels: each round's difference is 0.25 to 0.35
    peer = [1.0, 2.0, 1.0, 1.5, 1.0, 1.2, 1.0, 1.1, 1.0]
    diff = [0.30, 0.25, 0.35, 0.30, 0.28, 0.32, 0.30, 0.26, 0.34]
    ours = [p + d for p, d in zip(peer, diff, strict=True)]
    st = compare_difference(ours, peer)
    assert st.rounds == 9 and st.ratio == pytest.approx(1.35 - 1.0)  # medians 1.35 and 1.0
    assert st.low is not None and st.high is not None
    assert 0.0 < st.low <= st.ratio <= st.high < 1.0
    assert st.min == pytest.approx(0.25) and st.max == pytest.approx(0.35)
    # the same rounds but ours level with the peer: the interval holds 0
    level = compare_difference([p + d - 0.30 for p, d in zip(peer, diff, strict=True)], peer)
    assert level.low is not None and level.high is not None and level.low <= 0 <= level.high
    one = compare_difference([2.0], [1.0])
    assert (one.ratio, one.low, one.high) == (1.0, 1.0, 1.0)
    assert compare_difference([], []).ratio is None


def test_a_test_run_lands_in_no_ledger(tmp_path: Path) -> None:
    # conftest.py sets the default of --ledger to "none" for every test of this package
    parser = argparse.ArgumentParser()
    ledger.add_ledger_arg(parser)
    args = parser.parse_args([])
    assert args.ledger == ledger.OFF and ledger.ledger_dir(args) is None
    assert ledger.ledger_dir(parser.parse_args(["--ledger", str(tmp_path)])) == tmp_path
