# SPDX-License-Identifier: Apache-2.0
"""ascend-kv packages beside the real vLLM-Ascend wheel (nox session ``ascend-coexist``).

The session installs both, in both orders, uninstalls each and reinstalls,
and runs this file after each step with ``ASCEND_COEXIST`` naming the state:

* ``theirs-over-ours``: ours, then vLLM-Ascend: its copies hold the shared files
  (upstream's paths), and the connector names are still ours;
* ``repaired``: then ours reinstalled (puts our copies of upstream's paths back);
* ``both``: vLLM-Ascend, then ours (the other order);
* ``ours-removed``: ``uninstall`` of ours from ``both``;
* ``theirs-only``: vLLM-Ascend reinstalled after that;
* ``theirs-removed``: ``uninstall vllm-ascend`` from ``both``;
* ``ours-only``: ours reinstalled after that.

vLLM-Ascend's own plugins need ``torch_npu``; the engine tests keep them
out with ``VLLM_PLUGINS`` (ours named, theirs not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_ascend.distributed.kv_transfer.core.tooling import provenance

STATE = os.environ.get("ASCEND_COEXIST", "")
pytestmark = pytest.mark.skipif(not STATE, reason="run by the nox session ascend-coexist")

OUR_NAMES = {
    "MooncakeConnectorV1": "ascend-kv-p2p",
    "MooncakeLayerwiseConnector": "ascend-kv-p2p",
    "AscendStoreConnector": "ascend-kv-pool",
    "MooncakeConnectorStoreV1": "ascend-kv-pool",
    "CPUOffloadingConnector": "ascend-cpu-offload",
}
OUR_PLUGINS = ["ascend_kv_p2p", "ascend_kv_pool", "ascend_cpu_offload"]
UPSTREAM_NAMES = {
    "vllm_ascend.distributed.parallel_state": [
        "init_ascend_model_parallel", "get_mc2_group", "get_mlp_tp_group", "get_otp_group",
        "get_lmhead_tp_group", "get_embed_tp_group", "get_dynamic_eplb_group"],
    "vllm_ascend.distributed.utils": [
        "all_gather_async", "get_decode_context_model_parallel_world_size",
        "split_tensor_along_first_dim"],
    "vllm_ascend.distributed.device_communicators.npu_communicator": ["NPUCommunicator"],
}

# Runs in a fresh interpreter: the factory's registry is per process.
REGISTER = textwrap.dedent("""
    import importlib, importlib.metadata as md, inspect, json, sys
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm_ascend.distributed.kv_transfer.core.tooling import provenance
    order = sys.argv[1].split(",")
    eps = {e.name: e for e in md.entry_points(group="vllm.general_plugins")}
    for step in order:
        if step == "theirs":
            # vllm_ascend:register_connector first applies NPU patches (torch_npu);
            # this is the function it then imports and calls, at call time.
            importlib.import_module("vllm_ascend.distributed.kv_transfer").register_connector()
        else:
            eps[step].load()()
    by_path = {str(e.location): e for e in provenance.scan()}
    out = {}
    for name in json.loads(sys.argv[2]):
        if name not in KVConnectorFactory._registry:
            out[name] = [None, None, "not registered"]
            continue
        try:
            cls = KVConnectorFactory.get_connector_class_by_name(name)
        except Exception as e:  # vLLM-Ascend's copies need torch_npu
            out[name] = [None, None, f"{type(e).__name__}: {e}"]
            continue
        path = str(__import__("pathlib").Path(inspect.getfile(cls)).resolve())
        entry = by_path.get(path)
        out[name] = [cls.__module__, cls.__name__, entry.provider if entry else None]
    print(json.dumps(out))
""")


def _register(order: list[str]) -> dict[str, list[str | None]]:
    """name -> [module, class, providing distribution or why not] after running ``order``."""
    proc = subprocess.run([sys.executable, "-c", REGISTER, ",".join(order),
                           json.dumps(sorted(OUR_NAMES))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _installed(dist: str) -> bool:
    import importlib.metadata as md

    try:
        md.distribution(dist)
    except md.PackageNotFoundError:
        return False
    return True


def _site() -> Path:
    import importlib.metadata as md

    return Path(str(md.distribution("ascend-kv-core").locate_file(""))).resolve()


def _files_not_in_any_record() -> list[str]:
    listed = {str(e.location) for e in provenance.scan()}
    root = _site() / "vllm_ascend" / "distributed"
    return sorted(str(p.relative_to(_site())) for p in root.rglob("*.py")
                  if str(p.resolve()) not in listed)


def _doctor() -> list[dict[str, str]]:
    """``vllm-ascend-kv doctor --json``'s checks about ``vllm_ascend.distributed``."""
    cfg = json.dumps({"kv_connector": "CPUOffloadingConnector", "kv_role": "kv_both"})
    proc = subprocess.run([str(Path(sys.executable).parent / "vllm-ascend-kv"), "doctor",
                           "--kv-transfer-config", cfg, "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.stdout, proc.stderr[-3000:]
    return [c for c in json.loads(proc.stdout)["checks"]
            if c["what"].startswith("vllm_ascend.distributed")]


def _problems(fatal: bool | None = None) -> list[str]:
    return [str(p) for p in provenance.problems() if fatal is None or p.fatal == fatal]


# ------------------------------------------------------------------ both installed
#: both installed, in either order: the connector names are ours
either = pytest.mark.skipif(STATE not in ("both", "repaired", "theirs-over-ours"),
                            reason="both installed only")
#: both installed, ours last: ours hold upstream's paths too
both = pytest.mark.skipif(STATE not in ("both", "repaired"), reason="ours installed last only")


@either
@pytest.mark.parametrize("order", [OUR_PLUGINS + ["theirs"], ["theirs"] + OUR_PLUGINS,
                                   ["ascend_kv_p2p", "theirs", "ascend_kv_pool",
                                    "ascend_cpu_offload"]],
                         ids=["ours-then-theirs", "theirs-then-ours", "interleaved"])
def test_connector_names_resolve_to_ours_whichever_registers_first(order: list[str]) -> None:
    got = _register(order)
    assert {name: got[name][2] for name in OUR_NAMES} == OUR_NAMES, got


@either
def test_their_register_connector_still_registers_its_other_names() -> None:
    code = ("import importlib;"
            "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F;"
            "importlib.import_module('vllm_ascend.distributed.kv_transfer').register_connector();"
            "import vllm_ascend.distributed.kv_transfer.kv_p2p.plugin as p; p.register();"
            "r = F._registry; print(sorted(n for n in ('UCMConnector', 'MooncakeHybridConnector',"
            " 'SfaRemoteD2HConnector', 'RecomputeCPUOffloadConnector') if n in r))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MooncakeHybridConnector" in proc.stdout


@either
def test_every_upstream_name_resolves_to_ours_when_ours_came_last() -> None:
    import importlib

    by_module = {e.module: e for e in provenance.scan()}
    ours = provenance.our_distributions()
    for module, names in UPSTREAM_NAMES.items():
        mod = importlib.import_module(module)
        for name in names:
            assert hasattr(mod, name), f"{module}.{name}"
        provider = by_module[module].provider
        assert provider == "vllm-ascend" if STATE == "theirs-over-ours" else provider in ours, \
            by_module[module]
    kv = importlib.import_module("vllm_ascend.distributed.kv_transfer")
    assert callable(kv.register_connector)  # vLLM-Ascend's (we ship no __init__ there)


@both
def test_doctor_finds_nothing_wrong_and_names_providers() -> None:
    assert _problems() == []
    entries = {e.module: e for e in provenance.scan()}
    assert entries["vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_connector"].listed_by.keys() \
        == {"ascend-kv-p2p", "vllm-ascend"}
    assert entries["vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_connector"].provider \
        == "ascend-kv-p2p"


@both
def test_doctor_names_each_modules_provider() -> None:
    checks = _doctor()
    assert not [c for c in checks if c["status"] == "fail"], checks
    p2p = next(c for c in checks if c["what"].endswith("modules from ascend-kv-p2p"))
    assert "kv_transfer.kv_p2p.mooncake_connector" in p2p["detail"]
    assert "kv_transfer.kv_p2p.pull.connector" in p2p["detail"]
    theirs = next(c for c in checks if c["what"].endswith("modules from vllm-ascend"))
    assert "kv_transfer.kv_p2p.mooncake_hybrid_connector" in theirs["detail"]
    assert any("shipped by two distributions" in c["what"] for c in checks)


#: state -> (connector an engine serves with, its extra config, the module of our class)
ENGINES = {
    "both": ("CPUOffloadingConnector", {"cpu_swap_space": "64MB"},
             "vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_connector"),
    # a name whose upstream-path module holds vLLM-Ascend's copy in this state
    "theirs-over-ours": ("AscendStoreConnector", {"local_pool_size": "64MB"},
                         "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store"
                         ".store_connector"),
}


@pytest.mark.skipif(STATE not in ENGINES, reason="one engine start in two states")
def test_an_engine_serves_with_our_connector(tmp_path: Path) -> None:
    connector, extra, module = ENGINES[STATE]
    code = textwrap.dedent("""
        import json, sys
        from ascend_kv_testing.models import make_tiny_llama
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        if __name__ == "__main__":
            model = make_tiny_llama(sys.argv[1])
            llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="float32",
                      max_model_len=256, enforce_eager=True, max_num_seqs=4,
                      kv_transfer_config={"kv_connector": sys.argv[2],
                                          "kv_role": "kv_both",
                                          "kv_connector_extra_config": json.loads(sys.argv[3])})
            prompt = TokensPrompt(prompt_token_ids=list(range(1, 40)))
            sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False)
            a = llm.generate([prompt], sp)[0].outputs[0].token_ids
            b = llm.generate([prompt], sp)[0].outputs[0].token_ids
            assert list(a) == list(b) and len(a) == 8, (a, b)
            from vllm.distributed.kv_transfer import get_kv_transfer_group
            print("SERVED", type(get_kv_transfer_group()).__module__, list(a))
    """)
    env = {**os.environ, "VLLM_PLUGINS": ",".join(OUR_PLUGINS),
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "model"), connector,
                           json.dumps(extra)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "SERVED" in proc.stdout, proc.stderr[-4000:]
    assert f"SERVED {module} " in proc.stdout, proc.stdout[-2000:]  # our class served


# ------------------------------------------------------------------ the other states
@pytest.mark.skipif(STATE != "theirs-over-ours", reason="state 'theirs-over-ours' only")
def test_installing_vllm_ascend_after_ours_overwrites_only_upstream_paths() -> None:
    # every problem is a copy of theirs in an upstream path (an error: imports of that path
    # get their code), none a file of ours gone or shadowed
    joined = "\n".join(_problems(fatal=True))
    assert "kv_p2p.mooncake_connector: " in joined and "vLLM-Ascend's copy" in joined
    assert "vllm_ascend.distributed.parallel_state: " in joined
    assert all("vLLM-Ascend's copy" in p for p in _problems(fatal=True)), joined
    assert _problems(fatal=False) == []
    checks = _doctor()
    fails = [c for c in checks if c["status"] == "fail"]
    assert any(c["what"].endswith("(vllm_ascend.distributed.kv_transfer.kv_p2p"
                                  ".mooncake_connector)") and "vLLM-Ascend's copy" in c["detail"]
               and "--force-reinstall" in c["fix"] for c in fails), fails
    # what the connectors run is in files only we ship: untouched
    by_module = {e.module: e for e in provenance.scan()}
    prefix = "vllm_ascend.distributed.kv_transfer."
    for module, dist in {"kv_p2p.pull.connector": "ascend-kv-p2p",
                         "kv_p2p.layerwise.connector": "ascend-kv-p2p",
                         "kv_p2p.plugin": "ascend-kv-p2p",
                         "kv_pool.ascend_store.store_connector": "ascend-kv-pool",
                         "kv_pool.ascend_store.store_worker": "ascend-kv-pool",
                         "kv_pool.ascend_store.backend.registry": "ascend-kv-pool",
                         "kv_pool.ascend_store.plugin": "ascend-kv-pool"}.items():
        assert by_module[prefix + module].listed_by.keys() == {dist}, module
        assert by_module[prefix + module].provider == dist, module
    assert by_module[prefix + "kv_p2p.mooncake_connector"].provider == "vllm-ascend"


@pytest.mark.skipif(STATE != "ours-removed", reason="state 'ours-removed' only")
def test_uninstalling_ours_removes_the_shared_files_vllm_ascend_needs() -> None:
    assert provenance.our_distributions() == {"ascend-kv-core"}
    gone = [e.path for e in provenance.scan() if not e.exists]
    assert "vllm_ascend/distributed/parallel_state.py" in gone
    assert "vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_connector.py" in gone
    # what is left of vLLM-Ascend's own files still imports where it needs no shared file
    assert (_site() / "vllm_ascend" / "distributed" / "kv_transfer" / "__init__.py").is_file()


@pytest.mark.skipif(STATE != "theirs-only", reason="state 'theirs-only' only")
def test_reinstalling_vllm_ascend_restores_it_completely_and_nothing_of_ours_is_left() -> None:
    entries = provenance.scan()
    assert entries and all(e.exists and e.provider == "vllm-ascend" for e in entries
                           if "vllm-ascend" in e.listed_by)
    assert not any("ascend-kv-p2p" in e.listed_by for e in entries)
    assert _files_not_in_any_record() == []


@pytest.mark.skipif(STATE != "theirs-removed", reason="state 'theirs-removed' only")
def test_uninstalling_vllm_ascend_removes_our_shared_files_too() -> None:
    assert not _installed("vllm-ascend")
    errors = "\n".join(_problems(fatal=True))
    assert "vllm_ascend.distributed.parallel_state: " in errors and "is gone" in errors
    assert any("is gone" in c["detail"] for c in _doctor() if c["status"] == "fail")
    assert not (_site() / "vllm_ascend" / "__init__.py").exists()  # a namespace again
    # upstream's paths of ours are gone with it, but nothing the connectors run
    got = _register(OUR_PLUGINS)
    assert {name: got[name][2] for name in OUR_NAMES} == OUR_NAMES, got


@pytest.mark.skipif(STATE != "ours-only", reason="state 'ours-only' only")
def test_reinstalling_ours_gives_a_clean_environment() -> None:
    assert _problems() == []
    assert _files_not_in_any_record() == []
    assert not (_site() / "vllm_ascend" / "__init__.py").exists()
    got = _register(OUR_PLUGINS)
    assert {name: got[name][2] for name in OUR_NAMES} == OUR_NAMES
