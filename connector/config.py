"""The connector's settings, from `kv_connector_extra_config`, and the per-request store policy.

Operator settings are checked when the engine starts and a bad one stops it
with a message naming the key: a typo in a deployment should not silently turn
offloading off. Per-request settings (`kv_transfer_params`) come from end users
through the API server, so a bad one is logged and replaced by the default: it
must never fail the request or the engine.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvdepot.defaults import default_socket_path, read_token
from kvdepot.settings import ConfigError

log = logging.getLogger("kvdepot.connector")

# Keys of a request's kv_transfer_params that this connector reads.
PARAM_STORE = "kvdepot_store"
PARAM_STORE_DECODE = "kvdepot_store_decode"
PARAM_LOAD = "kvdepot_load"

MODES = ("eager", "lazy")

# Every key of kv_connector_extra_config (the README documents each).
EXTRA_CONFIG_KEYS = (
    "socket", "daemon_uids", "auth_token_file", "tls_ca_file", "tls_cert_file", "tls_key_file", "mode", "store",
    "store_decode",
    "min_prompt_tokens", "max_defer_s", "call_timeout_s", "connect_timeout_s", "model_id", "sync_loads",
    "promote_on_arrival",
)  # fmt: skip


@dataclass(frozen=True)
class StoreAmount:
    """How much of a prompt to store: everything, nothing, N tokens or a fraction."""

    kind: str  # "prompt", "none", "tokens", "fraction"
    value: float = 0.0

    def prompt_tokens(self, prompt_len: int) -> int:
        if self.kind == "prompt":
            return prompt_len
        if self.kind == "none":
            return 0
        if self.kind == "tokens":
            return min(prompt_len, int(self.value))
        return int(math.floor(prompt_len * self.value))


def parse_store_amount(value: Any) -> StoreAmount:
    """`"prompt"`, `"none"`, an int >= 0 (tokens) or a float in [0, 1] (fraction of the prompt)."""
    if isinstance(value, str):
        if value in ("prompt", "all"):
            return StoreAmount("prompt")
        if value == "none":
            return StoreAmount("none")
        raise ValueError(f'{value!r} is not "prompt", "none", a token count or a fraction')
    if isinstance(value, bool):  # bool is an int subclass; True/False are not amounts
        raise ValueError(f"{value!r} is a bool; use \"prompt\" or \"none\"")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a token count must be >= 0, not {value}")
        return StoreAmount("tokens", value)
    if isinstance(value, float):
        if not (0.0 <= value <= 1.0) or math.isnan(value):
            raise ValueError(f"a fraction must be between 0 and 1, not {value}")
        return StoreAmount("fraction", value)
    raise ValueError(f"{value!r} ({type(value).__name__}) is not a store amount")


@dataclass(frozen=True)
class StorePolicy:
    """What one request stores: a prefix of its prompt, and maybe its decode tokens."""

    amount: StoreAmount = StoreAmount("prompt")
    decode: bool = True
    load: bool = True

    def store_limit_tokens(self, prompt_len: int, total_tokens: int) -> int:
        """Tokens from the start of the sequence whose whole blocks may be stored."""
        prompt_part = self.amount.prompt_tokens(prompt_len)
        if self.decode and prompt_part == prompt_len:
            return total_tokens
        return prompt_part


@dataclass(frozen=True)
class ConnectorConfig:
    socket: str = field(default_factory=default_socket_path)
    auth_token: str | None = None
    # Uids besides root and the engine's own whose daemon the engine may talk
    # to on a unix socket (None: $KVDEPOT_DAEMON_UIDS, else none).
    daemon_uids: tuple[int, ...] | None = None
    # TLS towards a daemon on TCP (files: its CA; this engine's certificate and key).
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # eager: store blocks as they are computed; lazy: when the request finishes
    # or is preempted.
    mode: str = "eager"
    default_policy: StorePolicy = StorePolicy()
    # Requests with a shorter prompt store nothing by default.
    min_prompt_tokens: int = 0
    # After this long, a request stops waiting for a load or store of blocks it
    # shares (it loads what is ready, and computes the rest).
    max_defer_s: float = 5.0
    # Unary call timeout towards the daemon.
    call_timeout_s: float = 10.0
    # How long engine start-up waits for the daemon; without it, the engine
    # starts anyway (no offloading) and the client attaches when it can.
    connect_timeout_s: float = 5.0
    # Names the model's weights in the namespace instead of their fingerprint
    # or hub revision: engines with the same model_id share blocks.
    model_id: str | None = None
    # Where the workers copy in host memory (CPU engines, one KV-cache group):
    # a hit loads in the step that computes the rest of its prompt (lookup.py).
    sync_loads: bool = True
    # A request's blocks below DRAM (the daemon's disk, a remote store) are
    # asked for when it arrives; False: at its first lookup (lookup.py).
    promote_on_arrival: bool = True

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config: unknown key(s) {unknown} for KVDepotConnector; "
                f"known: {list(EXTRA_CONFIG_KEYS)}"
            )
        fields: dict[str, Any] = {}
        if "socket" in extra:
            fields["socket"] = _string(extra, "socket")
        if "daemon_uids" in extra:
            uids = extra["daemon_uids"]
            if not isinstance(uids, (list, tuple)) or not all(
                isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in uids
            ):
                raise ConfigError(
                    f"kv_connector_extra_config.daemon_uids must be a list of uids (numbers >= 0), not {uids!r}"
                )
            fields["daemon_uids"] = tuple(uids)
        for key in ("model_id", "tls_ca_file", "tls_cert_file", "tls_key_file"):
            if key in extra:
                fields[key] = _string(extra, key)
        if "auth_token_file" in extra:
            path = _string(extra, "auth_token_file")
            try:
                fields["auth_token"] = read_token(path)
            except ValueError as e:
                raise ConfigError(f"kv_connector_extra_config.auth_token_file: {e}") from None
        if "mode" in extra:
            mode = extra["mode"]
            if mode not in MODES:
                raise ConfigError(f"kv_connector_extra_config.mode must be one of {MODES}, not {mode!r}")
            fields["mode"] = mode
        amount, decode = StoreAmount("prompt"), True
        if "store" in extra:
            try:
                amount = parse_store_amount(extra["store"])
            except ValueError as e:
                raise ConfigError(f"kv_connector_extra_config.store: {e}") from e
        if "store_decode" in extra:
            if not isinstance(extra["store_decode"], bool):
                raise ConfigError(
                    f"kv_connector_extra_config.store_decode must be true or false, not {extra['store_decode']!r}"
                )
            decode = extra["store_decode"]
        for switch in ("sync_loads", "promote_on_arrival"):
            if switch in extra:
                if not isinstance(extra[switch], bool):
                    raise ConfigError(
                        f"kv_connector_extra_config.{switch} must be true or false, not {extra[switch]!r}"
                    )
                fields[switch] = extra[switch]
        fields["default_policy"] = StorePolicy(amount, decode)
        minimums = (("min_prompt_tokens", 0), ("max_defer_s", 0), ("call_timeout_s", 0.1), ("connect_timeout_s", 0))
        for key, minimum in minimums:
            if key in extra:
                value = extra[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
                    raise ConfigError(f"kv_connector_extra_config.{key} must be a number >= {minimum}, not {value!r}")
                fields[key] = int(value) if key == "min_prompt_tokens" else float(value)
        return cls(**fields)

    def client(self, name: str):
        """A KVDepotClient for these settings, attached if the daemon answers within connect_timeout_s.

        Without the daemon the engine starts anyway: the client attaches when it can.
        """
        from kvdepot.client import KVDepotClient
        from kvdepot.client.rpc import Tls

        tls = None
        if self.tls_ca_file or self.tls_cert_file:
            tls = Tls(self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        client = KVDepotClient(
            self.socket, name=name, auth_token=self.auth_token, tls=tls, call_timeout=self.call_timeout_s,
            daemon_uids=self.daemon_uids,
        )
        # Without the daemon the client has said so (once per process), and attaches when it can.
        client.wait_connected(self.connect_timeout_s)
        return client

    def policy_for(self, request_id: str, prompt_len: int, params: Mapping[str, Any] | None) -> StorePolicy:
        """The request's policy: its kv_transfer_params over the configured default.

        Bad values are logged and ignored, so one malformed request cannot fail.
        """
        policy = self.default_policy
        if prompt_len < self.min_prompt_tokens:
            policy = StorePolicy(StoreAmount("none"), False, policy.load)
        if not params:
            return policy
        amount, decode, load = policy.amount, policy.decode, policy.load
        if PARAM_STORE in params:
            try:
                amount = parse_store_amount(params[PARAM_STORE])
            except ValueError as e:
                log.warning("request %s: ignoring kv_transfer_params.%s: %s", request_id, PARAM_STORE, e)
        for key in (PARAM_STORE_DECODE, PARAM_LOAD):
            if key in params:
                value = params[key]
                if isinstance(value, bool):
                    if key == PARAM_LOAD:
                        load = value
                    else:
                        decode = value
                else:
                    log.warning(
                        "request %s: ignoring kv_transfer_params.%s: %r is not true or false", request_id, key, value
                    )
        return StorePolicy(amount, decode, load)


def _string(extra: Mapping[str, Any], key: str) -> str:
    value = extra[key]
    if not isinstance(value, str) or not value:
        raise ConfigError(f"kv_connector_extra_config.{key} must be a non-empty string, not {value!r}")
    return value
