# SPDX-License-Identifier: Apache-2.0
"""``kv_connector_extra_config`` of the P/D connectors (``ascend-kv-p2p``).

The keys of vLLM-Ascend (``prefill``/``decode`` with ``tp_size``, ``dp_size``,
``pp_size``, ``pp_layer_partition``; ``tls_config`` for the layerwise
metaserver) keep their meaning; the lease, deadline, protocol and retry keys are ours.
Each call the connectors retry has its own retry policy key (``claim_retry``,
``read_retry``, ``push_retry``, ``metaserver_retry``: a
:class:`~vllm_ascend.distributed.kv_transfer.core.retry.RetryPolicy` each, whose defaults
are that call's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from vllm_ascend.distributed.kv_transfer.core.config.base import ConfigSection, option
from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.core.retry import RetryPolicy

#: D's ``Claim`` that P answers "unknown request" (P's metadata for the request comes with
#: its next engine step): retried for 10 s at most, within the load's deadline.
CLAIM_RETRY = RetryPolicy(delay_s=0.01, max_delay_s=0.5, deadline_s=10.0)
#: D's pull after a stalled or dropped read, or a side-channel timeout: 8 retries at most,
#: each only while the load's deadline leaves its wait and ``delay_s`` more.
READ_RETRY = RetryPolicy(attempts=9, delay_s=0.25, max_delay_s=4.0)
#: P's ``PushBegin`` that D answers "unknown request" (D's worker learns of the request
#: with the step after its scheduler posted it to the metaserver): retried for 10 s at most.
PUSH_RETRY = RetryPolicy(delay_s=0.01, max_delay_s=0.5, deadline_s=10.0)
#: D's POST to the proxy's metaserver after a connection error or a 5xx answer: 3 retries.
METASERVER_RETRY = RetryPolicy(attempts=4, delay_s=0.05, max_delay_s=1.0)


@dataclass(frozen=True)
class ParallelSpec(ConfigSection):
    """Parallel layout of one side (prefill or decode) of a P/D deployment."""

    tp_size: int | None = option(
        None, minimum=1,
        doc="Tensor-parallel size of the instance; when set, each instance checks its own "
            "size at start-up and D checks P's at the handshake.")
    dp_size: int = option(1, doc="Data-parallel size of the instance.", minimum=1)
    pp_size: int = option(
        1, minimum=1,
        doc="Pipeline-parallel size of the instance. prefill.pp_size above 1: a "
            "pipeline-parallel P, served by MooncakeConnectorV1 (D reads each layer from the "
            "P stage that holds it; set it on P and D alike); refused by "
            "MooncakeLayerwiseConnector. decode.pp_size must be 1.")
    pp_layer_partition: list[int] | None = option(
        None, doc="Layers per pipeline stage, e.g. '3,5' or [3, 5]: pp_size entries adding up "
                  "to the model's layer count (the same as vLLM's VLLM_PP_LAYER_PARTITION on "
                  "P); default: vLLM's split (even, the remainder on the stages before the "
                  "last).")

    def validate(self, source: str) -> None:
        part = self.pp_layer_partition
        if part is not None:
            if len(part) != self.pp_size:
                raise ConfigError(
                    f"{source}: pp_layer_partition {part} has {len(part)} entries but pp_size is "
                    f"{self.pp_size}", key=f"{source}.pp_layer_partition", value=part, source=source)
            if any(n <= 0 for n in part):
                raise ConfigError(f"{source}: pp_layer_partition {part} must be positive",
                                  key=f"{source}.pp_layer_partition", value=part, source=source)


@dataclass(frozen=True)
class TLSConfig(ConfigSection):
    """TLS for the HTTP calls to the proxy's metaserver (layerwise connector)."""

    ssl_enable: bool = option(False, doc="Use HTTPS for the metaserver call.")
    ssl_keyfile: str | None = option(None, doc="Client private key (PEM).")
    ssl_certfile: str | None = option(None, doc="Client certificate (PEM).")
    ssl_ca_certs: str | None = option(None, doc="CA bundle used to verify the metaserver.")
    ssl_keyfile_password: str | None = option(None, doc="Password of the private key.")


@dataclass(frozen=True)
class MooncakeP2PConfig(ConfigSection):
    """Extra config of ``MooncakeConnectorV1`` (decode pulls)."""

    # Keys that upstream configs carry but nothing reads, accepted without a warning.
    passthrough_keys: ClassVar[frozenset[str]] = frozenset({"use_ascend_direct"})

    prefill: ParallelSpec = option(default_factory=ParallelSpec,
                                   doc="Parallel layout of the prefill (P) instances.")
    decode: ParallelSpec = option(default_factory=ParallelSpec,
                                  doc="Parallel layout of the decode (D) instances.")
    protocol: str | None = option(
        None, choices=("tcp", "rdma", "ascend", "local"),
        doc="Mooncake transport; default: 'ascend' on NPU, 'rdma' on CUDA, 'tcp' on CPU. "
            "'local': no Mooncake engine and no port at all, D reads P's KV from P's memory "
            "(process_vm_readv): P and D on one host, KV caches in host memory, D with "
            "ptrace rights over P; MooncakeConnectorV1 only (the layerwise push is refused).")
    device_name: str = option("", doc="RDMA device name(s) handed to the transfer engine.")
    lease_ttl_s: float = option(
        30.0, minimum=0.1,
        doc="How long P holds a request's blocks for D without hearing from it; D (once its "
            "scheduler looks at the request) and the P/D proxy (while D has the request) "
            "renew the lease, a lapsed lease frees the blocks.")
    max_hold_s: float = option(
        600.0, minimum=0.1,
        doc="The longest P (MooncakeConnectorV1) holds one request's blocks for D, counted "
            "from when it began holding them: renewals and claims extend the lease up to it "
            "and no further, so no peer (with the deployment key or not) keeps blocks held "
            "indefinitely. Past it the lease lapses and a claim is refused (D fails or "
            "recomputes the request). Keep it above the longest a request waits in D's queue "
            "plus load_timeout_s.")
    read_window_s: float = option(
        1.0, minimum=0.0,
        doc="How long (seconds) P keeps a finished request's blocks at least, counted from "
            "its hold, even after D's Done. D trusts a read that ends within this window "
            "(minus 0.5 s for the clocks of P and D) without claiming the request first, "
            "which takes the claim's round trip off the load; later reads are claimed as "
            "before. Capped at lease_ttl_s / 2 and max_hold_s / 2; 0 turns it off (every "
            "read is claimed).")
    load_timeout_s: float = option(
        120.0, minimum=0.1,
        doc="Deadline for D to receive a request's KV; afterwards the request fails or is "
            "recomputed per vLLM's kv_load_failure_policy.")
    handshake_timeout_s: float = option(
        10.0, minimum=0.1, doc="Timeout of one side-channel request to the peer.")
    num_recv_workers: int = option(4, minimum=1, doc="Threads on D that pull KV from P instances.")
    allowed_peer_hosts: list[str] = option(
        default_factory=list,
        doc="The hosts this instance dials because a request's kv_transfer_params name "
            "them (P's side channels on D, the metaserver's host on a layerwise D, D's side "
            "channels on a layerwise P): "
            "addresses, networks in CIDR notation (10.20.0.0/24) or host names, compared as "
            "written. Params that name any other host are refused before anything is "
            "dialed (the load fails as with invalid params; counted in "
            "auth_refused{socket=\"kv-params\",reason=\"not_allowed\"}). Empty (the "
            "default): any host, which without a deployment key lets whoever writes a "
            "request's params choose the host dialed (with a key, params carry their "
            "issuer's MAC, see docs/security.md).")
    inline_reads: bool = option(
        False,
        doc="D starts a small read that P's read window covers (at most 64 byte ranges, "
            "counted once ranges adjacent on both sides are merged) on "
            "vLLM's thread, in start_load_kv, and vLLM's get_finished polls its end: no "
            "hand-off to a pull thread and back. On 2 CPUs a one-block load measured 0.60-0.71 "
            "of the raw read this way, 0.32-0.54 on the pull threads (bench p2p). Claims, "
            "retries, same-host reads, head staging, larger reads and a read that ended after "
            "the window stay on the pull threads. Soaked (6,000 requests) and run under "
            "vLLM's client without a failed request; off by default: it saves tenths of a "
            "millisecond per small load and puts the submission (about 5 us a byte range) "
            "on vLLM's thread.")
    idle_wait_s: float = option(
        0.002, minimum=0.0, maximum=0.1,
        doc="On a step that runs no token (every request waits for its KV), how long D's "
            "worker waits for a load to end before it returns to vLLM, which steps again "
            "at once: a load that ends wakes it at once, so the wait costs no latency, and "
            "it keeps D's engine loop from taking a whole core while P computes or the "
            "transfer runs (on a host where they share cores). A request that arrives "
            "meanwhile waits at most this long. 0 turns it off.")

    claim_retry: RetryPolicy = option(
        default_factory=lambda: CLAIM_RETRY,
        doc="How D retries a Claim that P answers 'unknown request' (P learns of the "
            "request with its next engine step); also bounded by load_timeout_s.")
    read_retry: RetryPolicy = option(
        default_factory=lambda: READ_RETRY,
        doc="How D pulls again after a stalled or dropped read or a side-channel timeout "
            "(on a fresh session, every P rank claimed first); a retry is made only while "
            "load_timeout_s leaves its wait plus delay_s. With attempts 1, an inline read "
            "(inline_reads) that failed fails the load instead of being pulled again.")

    @property
    def hold_window_s(self) -> float:
        """``read_window_s`` as P applies it (at most half the lease, and half the hold
        limit: a lease that lapses frees the blocks at once)."""
        return min(self.read_window_s, self.lease_ttl_s / 2, self.max_hold_s / 2)

    def validate(self, source: str) -> None:
        if self.decode.pp_size != 1:
            raise ConfigError(f"{source}: decode.pp_size must be 1 (pipeline parallel decode is "
                              f"not supported), got {self.decode.pp_size}",
                              key=f"{source}.decode.pp_size", value=self.decode.pp_size,
                              source=source)


@dataclass(frozen=True)
class MooncakeLayerwiseConfig(MooncakeP2PConfig):
    """Extra config of ``MooncakeLayerwiseConnector`` (prefill pushes per layer)."""

    tls_config: TLSConfig = option(default_factory=TLSConfig,
                                   doc="TLS for the HTTP call to the proxy's metaserver.")
    metaserver_urls: list[str] = option(
        default_factory=list,
        doc="The proxies' metaserver URLs D may post a request's blocks to (with the "
            "deployment key's bearer token): a request whose params name another "
            "'metaserver' is refused before anything is posted. Empty (the default): the "
            "params' URL, which with a deployment key the proxy MACs with the params.")
    metaserver_timeout_s: float = option(5.0, minimum=0.1,
                                         doc="Timeout of one POST to the metaserver.")
    metaserver_retry: RetryPolicy = option(
        default_factory=lambda: METASERVER_RETRY,
        doc="How D retries a metaserver POST that failed on a connection error or a 5xx "
            "answer (a 4xx answer is final).")
    metaserver_retries: int | None = option(
        None, minimum=0,
        doc="Retries of a failed metaserver POST, the older key: when set, it replaces "
            "metaserver_retry.attempts by this plus one (null: metaserver_retry applies).")
    push_retry: RetryPolicy = option(
        default_factory=lambda: PUSH_RETRY,
        doc="How P retries a PushBegin that D answers 'unknown request' (D's worker learns "
            "of the request with the step after its scheduler posted it).")
    save_wait_s: float = option(
        30.0, minimum=0.01,
        doc="How long P's wait_for_save waits for the step's layer pushes before the engine "
            "goes on (their requests keep their blocks until the pushes end).")

    @property
    def metaserver_policy(self) -> RetryPolicy:
        """The metaserver posts' retries: ``metaserver_retry``, its attempts set by
        ``metaserver_retries`` where that is given."""
        if self.metaserver_retries is None:
            return self.metaserver_retry
        return dataclasses.replace(self.metaserver_retry, attempts=self.metaserver_retries + 1)

    def validate(self, source: str) -> None:
        super().validate(source)
        if self.prefill.pp_size != 1:
            raise ConfigError(
                f"{source}: prefill.pp_size must be 1 for MooncakeLayerwiseConnector (P pushes "
                f"every layer from one pipeline stage; a pipeline-parallel P is served by the "
                f"pull connector, MooncakeConnectorV1), got {self.prefill.pp_size}",
                key=f"{source}.prefill.pp_size", value=self.prefill.pp_size, source=source)
