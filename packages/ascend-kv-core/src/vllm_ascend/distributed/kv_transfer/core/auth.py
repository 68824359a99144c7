# SPDX-License-Identifier: Apache-2.0
"""The deployment secret that authenticates the control plane.

Every instance of one deployment shares a key. With a key configured, every
control-plane frame (:mod:`.channel`, both directions) travels **encrypted** in an
envelope::

    b"VAKA" | version (1) | timestamp ms (8) | nonce (16) | receiver tag (8)
    | AES-256-GCM(wire frame) | GCM tag (16)

The :mod:`.wire` frame is encrypted and authenticated with AES-256-GCM (``cryptography``'s
AEAD, the 16-byte random nonce as its IV) under a key derived from the deployment key with
HKDF-SHA256 (:data:`AEAD_INFO`); nobody without the key reads a grant, a request id or a
capability token on the wire. The tag also covers, as associated data, the envelope's
header fields, a direction tag (a reply is bound to the nonce of the request it answers)
and a request's **receiver** (its *audience*: the socket it is sent to, e.g.
``port:17000``, and the receiving instance's engine id where the sender knows it, e.g.
``engine:P-1|port:17000``: :func:`audience_of`; the header carries a short tag of it). A
receiver refuses, with an :class:`AuthError` naming the reason, and counts in the
``auth_refused`` metric (``vllm:ascend_kv_auth_refused_total{socket,reason}``):

* ``unauthenticated``: a plain wire frame (no envelope) where a key is configured;
* ``bad_mac``: the tag checks under none of the active keys (another key, or a byte of the
  envelope changed);
* ``stale``: the timestamp is further than the window (default 30 s) from the clock;
* ``replay``: a nonce already seen within the window (or too old to tell, once the
  bounded replay cache overflowed);
* ``misdirected``: a request sealed for another receiver (a frame captured on its way to
  one rank or instance and sent to another: each process keeps its own replay cache, the
  binding is what refuses it there);
* ``malformed``: an envelope too short to hold its header and tag, or of another version
  (version 2, HMAC-SHA256 over a frame in clear, is no longer accepted: every instance of a
  deployment upgrades together).

Configuration (environment, read once per process):

* ``VLLM_ASCEND_KV_AUTH_KEY``: the key(s), comma-separated;
* ``VLLM_ASCEND_KV_AUTH_KEY_FILE``: file(s), comma-separated, one key per line
  (blank lines and ``#`` comments ignored); set one of the two, not both;
* ``VLLM_ASCEND_KV_AUTH_WINDOW_S``: the timestamp window in seconds (default 30).

Several keys may be active at once, for a rotation without downtime: the first
signs, every one verifies. Roll out ``old,new`` everywhere (everyone accepts the
new key), then ``new,old`` (everyone signs with it), then ``new``.

Without a key nothing changes on the wire (same bytes as before), and every server runs
in protected mode (:mod:`.protected`): it serves only peers on its own host, until
``VLLM_ASCEND_KV_ALLOW_UNAUTHENTICATED=1`` opens it to every host (logged once per process
as a WARNING). :func:`mode` says which of ``keyed``, ``protected`` and ``open`` applies.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import ConfigError, WireFormatError
from .metrics import MetricSpec, MetricsRecorder

logger = logging.getLogger(__name__)

ENV_KEY = "VLLM_ASCEND_KV_AUTH_KEY"
ENV_KEY_FILE = "VLLM_ASCEND_KV_AUTH_KEY_FILE"
ENV_WINDOW = "VLLM_ASCEND_KV_AUTH_WINDOW_S"
#: Without a key, serve every host (not only this one): the opt-out of protected mode.
ENV_ALLOW_UNAUTHENTICATED = "VLLM_ASCEND_KV_ALLOW_UNAUTHENTICATED"

AUTH_MAGIC = b"VAKA"
#: 3: the frame encrypted (AES-256-GCM); 2: HMAC-SHA256, the receiver (audience) in the MAC
#: and its tag in the header; 1 had neither
AUTH_VERSION = 3
NONCE_BYTES = 16
AUDIENCE_TAG_BYTES = 8
#: the GCM authentication tag after the encrypted frame
TAG_BYTES = 16
#: magic, version, timestamp (ms since the epoch), nonce, receiver tag (all associated data)
_HEADER = struct.Struct(f">4sBQ{NONCE_BYTES}s{AUDIENCE_TAG_BYTES}s")
HEADER_BYTES = _HEADER.size
#: bytes an envelope adds to a wire frame
OVERHEAD_BYTES = HEADER_BYTES + TAG_BYTES
#: HKDF's ``info``: the control plane's AEAD key is derived from each deployment key with it
AEAD_INFO = b"vllm-ascend-kv control plane AES-256-GCM v3"
MIN_KEY_BYTES = 16
DEFAULT_WINDOW_S = 30.0
DEFAULT_MAX_NONCES = 1 << 17

#: Refusal reasons of frames (the ``reason`` label of ``auth_refused``); bearer tokens and
#: per-request capabilities add ``bad_token``, protected mode :data:`REASON_PROTECTED_MODE`.
REASONS = ("unauthenticated", "bad_mac", "stale", "replay", "misdirected", "malformed")
#: A peer on another host refused by a server without a key (:mod:`.protected`).
REASON_PROTECTED_MODE = "protected_mode"
#: The control plane's modes (:func:`mode`).
MODE_KEYED, MODE_PROTECTED, MODE_OPEN = "keyed", "protected", "open"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
#: The bearer token's purpose on the proxy's ``/v1/metaserver``.
PURPOSE_METASERVER = "metaserver"

AUTH_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("auth_refused", "counter",
               "Control-plane frames refused by the deployment-key check.",
               labels=("socket", "reason")),
)
#: Process-wide recorder of refusals; connectors merge its interval data into theirs
#: (:class:`~.vllm_metrics.ConnectorStatsMixin`), tests read :meth:`MetricsRecorder.total`.
RECORDER = MetricsRecorder(AUTH_METRICS)


class AuthError(WireFormatError):
    """A frame failed the deployment-key check.

    Attributes:
        reason: one of :data:`REASONS`.
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def count_refusal(socket: str, reason: str) -> None:
    """Count one refused frame (or bearer token) on ``socket``."""
    RECORDER.inc("auth_refused", socket=socket, reason=reason)


def _parse_keys(text: str, source: str, *, sep: str) -> list[bytes]:
    keys: list[bytes] = []
    for raw in text.split(sep):
        item = raw.strip()
        if not item or item.startswith("#"):
            continue
        key = item.encode()
        if len(key) < MIN_KEY_BYTES:
            # never echo the key itself
            raise ConfigError(f"a key in {source} is {len(key)} bytes; at least "
                              f"{MIN_KEY_BYTES} are required (e.g. `openssl rand -hex 32`)",
                              key=source, source=source)
        keys.append(key)
    return keys


def load_keys(env: Mapping[str, str] | None = None) -> tuple[bytes, ...]:
    """The active keys from the environment, signing key first; ``()`` when none is set.

    Raises:
        ConfigError: both variables set, an unreadable file, a file without a key, or a
            key shorter than :data:`MIN_KEY_BYTES`.
    """
    env = os.environ if env is None else env
    inline = env.get(ENV_KEY, "").strip()
    files = env.get(ENV_KEY_FILE, "").strip()
    if inline and files:
        raise ConfigError(f"set {ENV_KEY} or {ENV_KEY_FILE}, not both", key=ENV_KEY,
                          source="environment")
    if inline:
        return tuple(_parse_keys(inline, ENV_KEY, sep=","))
    keys: list[bytes] = []
    for path in (p.strip() for p in files.split(",")):
        if not path:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise ConfigError(f"cannot read the key file {path!r} named by {ENV_KEY_FILE}: "
                              f"{exc}", key=ENV_KEY_FILE, value=path,
                              source="environment") from exc
        if mode & 0o077:
            logger.warning("key file %s is readable by group or others (mode %o); "
                           "chmod 600 it", path, mode & 0o777)
        found = _parse_keys(text, f"{ENV_KEY_FILE} file {path}", sep="\n")
        if not found:
            raise ConfigError(f"key file {path!r} named by {ENV_KEY_FILE} holds no key",
                              key=ENV_KEY_FILE, value=path, source="environment")
        keys.extend(found)
    return tuple(keys)


def load_window(env: Mapping[str, str] | None = None) -> float:
    """The timestamp window from :data:`ENV_WINDOW` (seconds, default 30)."""
    env = os.environ if env is None else env
    raw = env.get(ENV_WINDOW, "").strip()
    if not raw:
        return DEFAULT_WINDOW_S
    try:
        window = float(raw)
    except ValueError:
        window = -1.0
    if not window > 0:
        raise ConfigError(f"{ENV_WINDOW}={raw!r} is not a positive number of seconds",
                          key=ENV_WINDOW, value=raw, source="environment")
    return window


def allow_unauthenticated(env: Mapping[str, str] | None = None) -> bool:
    """Whether :data:`ENV_ALLOW_UNAUTHENTICATED` opts out of protected mode.

    Raises:
        ConfigError: a value that is neither true (``1``, ``true``, ``yes``, ``on``) nor
            false (``0``, ``false``, ``no``, ``off``, empty).
    """
    env = os.environ if env is None else env
    raw = env.get(ENV_ALLOW_UNAUTHENTICATED, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{ENV_ALLOW_UNAUTHENTICATED}={raw!r} is neither 1 nor 0",
                      key=ENV_ALLOW_UNAUTHENTICATED, value=raw, source="environment")


def mode(env: Mapping[str, str] | None = None) -> str:
    """The control plane's mode: :data:`MODE_KEYED` (a key is set), :data:`MODE_OPEN`
    (no key, protected mode opted out of) or :data:`MODE_PROTECTED` (no key: servers
    serve only peers on their own host)."""
    if configured(env):
        return MODE_KEYED
    return MODE_OPEN if allow_unauthenticated(env) else MODE_PROTECTED


class ReplayCache:
    """Nonces seen within the window, bounded.

    When more than ``max_entries`` nonces are inside the window, the oldest is
    forgotten and every frame stamped at or before it is refused from then on
    (a replay of it could no longer be told apart).
    """

    def __init__(self, window_s: float, max_entries: int = DEFAULT_MAX_NONCES) -> None:
        self.window_ms = int(window_s * 1000)
        self.max_entries = max_entries
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._floor_ms = -1
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, nonce: bytes, ts_ms: int, now_ms: int) -> bool:
        """Remember ``nonce``; False if it was seen (or cannot be told apart from a replay)."""
        with self._lock:
            horizon = now_ms - 2 * self.window_ms
            while self._seen:
                first_nonce, first_ts = next(iter(self._seen.items()))
                if first_ts >= horizon:
                    break
                del self._seen[first_nonce]
            if ts_ms <= self._floor_ms or nonce in self._seen:
                return False
            self._seen[nonce] = ts_ms
            while len(self._seen) > self.max_entries:
                _n, ts = self._seen.popitem(last=False)
                self._floor_ms = max(self._floor_ms, ts)
            return True


class Authenticator:
    """Seals and opens control-plane frames with the deployment key(s).

    Args:
        keys: active keys, the first signs; at least one.
        window_s: how far a frame's timestamp may be from this clock.
        max_nonces: bound of the replay cache.
        clock: seconds since the epoch (tests pass their own).
    """

    def __init__(self, keys: Sequence[bytes], *, window_s: float = DEFAULT_WINDOW_S,
                 max_nonces: int = DEFAULT_MAX_NONCES,
                 clock: Callable[[], float] = time.time) -> None:
        if not keys:
            raise ConfigError("an Authenticator needs at least one key")
        self.keys = tuple(keys)
        self.window_s = window_s
        self.clock = clock
        self.replays = ReplayCache(window_s, max_nonces)
        #: the AEAD of each key, the sealing key's first
        self._aeads = tuple(_aead(k) for k in self.keys)

    # ------------------------------------------------------------ frames
    @staticmethod
    def _context(reply_to: bytes | None, audience: str = "") -> bytes:
        # a request and a reply never verify as each other; a reply verifies only
        # against the request it answers, a request only at the receiver it was sealed for
        if reply_to is not None:
            return b"R" + reply_to
        return b"Q" + audience.encode()

    def seal(self, payload: bytes, *, reply_to: bytes | None = None,
             audience: str = "") -> tuple[bytes, bytes]:
        """Encrypt a wire frame into an envelope.

        Args:
            payload: the encoded :mod:`.wire` frame.
            reply_to: the nonce of the request this frame answers (replies only).
            audience: the receiver a request is for (:func:`audience_of`); only a receiver
                that opens it with the same audience accepts it.

        Returns:
            The envelope and its nonce (a client checks the reply against it).
        """
        nonce = secrets.token_bytes(NONCE_BYTES)
        tag = audience_tag(audience if reply_to is None else "")
        header = _HEADER.pack(AUTH_MAGIC, AUTH_VERSION, int(self.clock() * 1000), nonce, tag)
        sealed = self._aeads[0].encrypt(nonce, bytes(payload),
                                        header + self._context(reply_to, audience))
        return header + sealed, nonce

    def open(self, frame: bytes | memoryview, *, reply_to: bytes | None = None,
             audience: str = "") -> tuple[memoryview, bytes]:
        """Check and decrypt an envelope; returns the wire frame inside and the envelope's
        nonce.

        Requests (``reply_to`` None) must be sealed for ``audience`` (this receiver) and go
        through the replay cache; a reply is bound to its request's nonce instead.

        Raises:
            AuthError: the frame is refused (``reason`` says why).
        """
        view = memoryview(frame)
        if len(view) < 4 or bytes(view[:4]) != AUTH_MAGIC:
            raise AuthError("frame is not authenticated (no deployment-key envelope); "
                            "the peer has no key configured", reason="unauthenticated")
        if len(view) < OVERHEAD_BYTES:
            raise AuthError(f"authenticated frame of {len(view)} bytes is shorter than its "
                            f"{HEADER_BYTES}-byte header and {TAG_BYTES}-byte tag",
                            reason="malformed")
        _magic, version, ts_ms, nonce, tag = _HEADER.unpack_from(view)
        if version != AUTH_VERSION:
            raise AuthError(f"envelope version {version} is not supported (this side speaks "
                            f"{AUTH_VERSION}): every instance of a deployment must run a "
                            "release with the same envelope", reason="malformed")
        if reply_to is None and not hmac.compare_digest(tag, audience_tag(audience)):
            raise AuthError(f"frame was sealed for another receiver, not this one "
                            f"({audience or 'no audience'}): a frame captured on its way to "
                            "another rank or instance", reason="misdirected")
        associated = bytes(view[:HEADER_BYTES]) + self._context(reply_to, audience)
        sealed = bytes(view[HEADER_BYTES:])
        payload = None
        for aead in self._aeads:
            try:
                payload = aead.decrypt(nonce, sealed, associated)
                break
            except InvalidTag:
                continue
        if payload is None:
            raise AuthError("frame's authentication tag checks under none of the configured "
                            "keys", reason="bad_mac")
        now_ms = int(self.clock() * 1000)
        if abs(now_ms - ts_ms) > self.window_s * 1000:
            raise AuthError(f"frame timestamp is {(now_ms - ts_ms) / 1000:.1f}s from this "
                            f"clock, outside the {self.window_s:g}s window", reason="stale")
        if reply_to is None and not self.replays.add(nonce, ts_ms, now_ms):
            raise AuthError("frame nonce was already seen (replay)", reason="replay")
        return memoryview(payload), nonce

    # ------------------------------------------------------------ bearer tokens
    def bearer_token(self, purpose: str) -> str:
        """The bearer token of ``purpose`` (e.g. ``"metaserver"``) under the signing key."""
        return _token(self.keys[0], purpose)

    def purpose_keys(self, purpose: str) -> tuple[bytes, ...]:
        """A key of ``purpose`` derived from each active key (the signing key's first): to
        MAC data that travels outside the sealed frames (e.g. through a proxy)."""
        return tuple(_token(k, purpose).encode() for k in self.keys)

    def check_bearer(self, presented: str | None, purpose: str) -> bool:
        """True if ``presented`` is the token of ``purpose`` under any active key."""
        if not presented:
            return False
        given = presented.encode()
        return any(hmac.compare_digest(_token(k, purpose).encode(), given) for k in self.keys)

    def check_header(self, header: str | None, purpose: str) -> bool:
        """True if an HTTP ``Authorization`` header carries the bearer token of ``purpose``."""
        if not header:
            return False
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and self.check_bearer(token.strip(), purpose)


def _aead(key: bytes) -> AESGCM:
    """The control plane's AEAD under ``key``: AES-256-GCM with a key derived by HKDF."""
    derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                   info=AEAD_INFO).derive(key)
    return AESGCM(derived)


def audience_tag(audience: str) -> bytes:
    """The header's short tag of a receiver (the MAC covers the receiver itself)."""
    return hashlib.sha256(b"vllm-ascend-kv audience " + audience.encode()).digest()[
        :AUDIENCE_TAG_BYTES]


def audience_of(endpoint: str, engine_id: str = "") -> str:
    """The receiver a frame sent to ``endpoint`` is bound to: ``port:N`` of a
    ``tcp://host:N`` endpoint (each rank of each instance on a host listens on its own
    port, and a client and its server name the port alike, whatever address or name the
    client dials); the transport alone otherwise (``ipc``, ``inproc``: a file or an object
    of one process, whose path a client and its server may spell differently).

    With ``engine_id`` (the receiving instance's vLLM ``engine_id``, which a client learns
    from the request's ``kv_transfer_params``): ``engine:<id>|port:N``, so a frame captured
    on its way to one instance is refused by another listening on the same port number on
    another host (every instance of a fleet usually has the same ports)."""
    transport, _, rest = endpoint.partition("://")
    port = rest.rsplit(":", 1)[-1]
    base = f"port:{int(port)}" if transport == "tcp" and port.isdigit() else transport
    return f"engine:{engine_id}|{base}" if engine_id else base


def _token(key: bytes, purpose: str) -> str:
    return hmac.new(key, b"vllm-ascend-kv bearer " + purpose.encode(),
                    hashlib.sha256).hexdigest()


def capability_token() -> str:
    """An unguessable per-request token (a capability P hands out with a held request)."""
    return secrets.token_urlsafe(24)


def tokens_match(expected: str, presented: str) -> bool:
    """Constant-time comparison of two capability tokens."""
    return hmac.compare_digest(expected.encode(), presented.encode())


def capability_ok(expected: str, presented: str, *, keyed: bool, socket: str) -> bool:
    """Whether a message presenting ``presented`` may act on a request issued ``expected``.

    With a deployment key (``keyed``) the token is required and must match. Without one, a
    message without a token is let through (old peers, old params: without a key anyone
    who reaches the socket gets the memory map anyway), while a wrong token is refused.
    A refusal is counted as ``bad_token`` on ``socket``.
    """
    if not presented and not keyed:
        return True
    ok = bool(expected) and tokens_match(expected, presented)
    if not ok:
        count_refusal(socket, "bad_token")
    return ok


# ---------------------------------------------------------------- process default
_cache_lock = threading.Lock()
_cached: tuple[tuple[str, str, str], Authenticator | None] | None = None
_warned = False


def from_env(env: Mapping[str, str] | None = None) -> Authenticator | None:
    """The process's authenticator from the environment, or ``None`` without a key.

    Built once per distinct setting and shared by every socket of the process (one
    replay cache). Without a key, logs once which mode applies: protected (INFO) or, with
    :data:`ENV_ALLOW_UNAUTHENTICATED`, open to every host (a WARNING).

    Raises:
        ConfigError: see :func:`load_keys` and :func:`load_window`.
    """
    global _cached, _warned
    env = os.environ if env is None else env
    ident = (env.get(ENV_KEY, ""), env.get(ENV_KEY_FILE, ""), env.get(ENV_WINDOW, ""))
    with _cache_lock:
        if _cached is not None and _cached[0] == ident:
            return _cached[1]
        keys = load_keys(env)
        auth = Authenticator(keys, window_s=load_window(env)) if keys else None
        _cached = (ident, auth)
        if auth is None and not _warned:
            _warned = True
            if allow_unauthenticated(env):
                logger.warning(
                    "The KV control plane is UNAUTHENTICATED and serves every host (%s=1): "
                    "anyone who reaches a side channel, lookup or metadata socket can read "
                    "KV memory addresses and hold or free blocks. Set %s or %s to a shared "
                    "deployment key (see docs/security.md).", ENV_ALLOW_UNAUTHENTICATED,
                    ENV_KEY_FILE, ENV_KEY)
            else:
                logger.info(
                    "No deployment key: the KV control plane runs in protected mode, its "
                    "servers answer peers on this host only. Across hosts, set %s or %s to "
                    "a shared deployment key (see docs/security.md).", ENV_KEY_FILE, ENV_KEY)
        elif auth is not None:
            logger.info("KV control plane authenticated with %d active key(s), %gs window",
                        len(auth.keys), auth.window_s)
        return auth


def configured(env: Mapping[str, str] | None = None) -> bool:
    """Whether a deployment key is set in the environment (without loading it)."""
    env = os.environ if env is None else env
    return bool(env.get(ENV_KEY, "").strip() or env.get(ENV_KEY_FILE, "").strip())
