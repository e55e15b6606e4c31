"""Who a client is, and which tenant it acts for.

Identity comes from the kernel (the peer's uid, gid and pid on a unix socket,
server/api/peer.py) or from a credential (a token on TCP), never from what a
client says. An operator maps identities to tenants in the configuration file:

    [[tenant]]
    name = "team-a"          # letters, digits, '.', '_' or '-'
    uids = [1000, 1001]      # unix-socket peers with these uids ...
    gids = [3000]            # ... or this primary gid
    token_file = "/etc/kvdepot/team-a.token"   # TCP clients sending this token ...
    cert_names = ["engine-a.example"]          # ... or presenting a client certificate of this name
    share = "llama-fleet"    # optional sharing group: tenants naming the same one share blocks
    quota = "40%"            # optional: the most of the pool its scope may hold ("40%" or "16GiB")
    admin = false            # may see every tenant's stats and clear everything
    remote_secret_file = "/etc/kvdepot/llama-fleet.secret"  # optional: shares through --remote
    remote_old_secret_files = ["/etc/kvdepot/llama-fleet.old"]  # still read while rotating

A unix peer that no entry names is a tenant of its own, "uid-UID". A tenant's
namespaces belong to its scope (its sharing group, else itself): a client sees,
loads and clears the blocks of its scope only.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
from dataclasses import dataclass, field

from kvdepot import defaults
from kvdepot.server.host.peer import Peer
from kvdepot.settings import parse_size

log = logging.getLogger("kvdepot.tenants")

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_KEYS = {
    "name", "uids", "gids", "token_file", "cert_names", "share", "quota", "admin",
    "remote_secret_file", "remote_old_secret_files",
}
# The remote tier's HMAC is only as strong as its secret.
MIN_REMOTE_SECRET_BYTES = 16
_QUOTA = re.compile(r"\s*(\d+(?:\.\d+)?)\s*%\s*")


class TenantConfigError(ValueError):
    """A [[tenant]] table or admin_uids that cannot be used; the message names
    the table and the key. The daemon reports it as a configuration error."""


@dataclass(frozen=True)
class TenantSpec:
    name: str
    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()
    token: str | None = None
    share: str | None = None
    admin: bool = False
    # "40%" of the pool, or a size ("16GiB"); None: an equal part when the pool is full.
    quota: str | None = None
    # Common names or subject alternative names of TCP clients' certificates.
    cert_names: frozenset[str] = frozenset()
    # The remote tier's secret for the scope's values (none: the tenant never
    # publishes or fetches), and old ones still accepted while rotating.
    remote_secret: bytes | None = field(default=None, repr=False)
    remote_old_secrets: tuple[bytes, ...] = field(default=(), repr=False)

    @property
    def scope(self) -> str:
        return self.share or self.name


@dataclass(frozen=True)
class Identity:
    """A session's proven identity."""

    tenant: str
    # Namespaces are made and found per scope: the tenant, or its sharing group.
    scope: str
    admin: bool
    # From the kernel on a unix socket; None on TCP. pid 0: not visible here.
    uid: int | None = None
    gid: int | None = None
    pid: int = 0

    def describe(self) -> str:
        who = f"uid {self.uid} pid {self.pid or '?'}" if self.uid is not None else "a token"
        return f"tenant {self.tenant} ({who}{', admin' if self.admin else ''})"


class Tenants:
    def __init__(self, specs: list[TenantSpec], admin_uids: frozenset[int], default_token: str | None = None):
        self._specs = specs
        self._admin_uids = admin_uids
        # --auth-token-file: the token of a single-tenant TCP deployment, whose
        # holder runs the daemon's node and so administers it.
        self._default_token = default_token

    def for_peer(self, peer: Peer) -> Identity:
        spec = next((s for s in self._specs if peer.uid in s.uids), None)
        if spec is None:
            spec = next((s for s in self._specs if peer.gid in s.gids), None)
        if spec is None:
            name = f"uid-{peer.uid}"
            return Identity(name, name, peer.uid in self._admin_uids, peer.uid, peer.gid, peer.pid)
        admin = spec.admin or peer.uid in self._admin_uids
        return Identity(spec.name, spec.scope, admin, peer.uid, peer.gid, peer.pid)

    def for_token(self, token: str) -> Identity | None:
        """The identity a TCP client's token proves, or None for an unknown token."""
        found = None
        # Every token is compared, in constant time each, so the time taken
        # does not tell which tenant's token was nearly right.
        for spec in self._specs:
            if spec.token is not None and hmac.compare_digest(spec.token.encode(), token.encode()):
                found = Identity(spec.name, spec.scope, spec.admin)
        if self._default_token is not None and hmac.compare_digest(self._default_token.encode(), token.encode()):
            found = found or Identity("token", "token", True)
        return found

    def for_certificate(self, names: list[str]) -> Identity | None:
        """The identity a verified TCP client certificate (its CN and SANs) proves."""
        for spec in self._specs:
            if spec.cert_names & set(names):
                return Identity(spec.name, spec.scope, spec.admin)
        return None

    @property
    def has_tokens(self) -> bool:
        return self._default_token is not None or any(s.token is not None for s in self._specs)


def default_admin_uids() -> frozenset[int]:
    """root and the daemon's own user."""
    return frozenset({0, os.getuid()})


def parse_admin_uids(text: str, option: str = "admin_uids") -> frozenset[int]:
    """A list of uids (admin_uids); empty: root and the daemon's user."""
    if not text.strip():
        return default_admin_uids()
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise TenantConfigError(f"{option} must be uids separated by commas, not {text!r}") from None


def parse_tenants(entries, source: str) -> list[TenantSpec]:
    """The [[tenant]] tables of the configuration file."""
    if not isinstance(entries, list):
        raise TenantConfigError(f"{source}: 'tenant' must be an array of tables ([[tenant]])")
    specs: list[TenantSpec] = []
    seen_uids: dict[int, str] = {}
    for position, entry in enumerate(entries):
        where = f"{source}: tenant {position + 1}"
        if not isinstance(entry, dict):
            raise TenantConfigError(f"{where} is not a table")
        unknown = sorted(set(entry) - _KEYS)
        if unknown:
            raise TenantConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}")
        name = entry.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name.startswith("uid-") or name == "token":
            raise TenantConfigError(
                f"{where}: name must be 1-64 letters, digits, '.', '_' or '-' (and neither start with 'uid-' "
                "nor be 'token', the names of default tenants)"
            )
        if any(s.name == name for s in specs):
            raise TenantConfigError(f"{where}: tenant {name} is defined twice")
        share = entry.get("share")
        if share is not None and (not isinstance(share, str) or not _NAME.fullmatch(share)):
            raise TenantConfigError(f"{where}: share must be 1-64 letters, digits, '.', '_' or '-'")
        if share is not None and (share.startswith("uid-") or share == "token"):
            # Those are the scopes of default tenants: sharing one would join them unasked.
            raise TenantConfigError(f"{where}: share {share!r} is reserved (it names a default tenant)")
        uids, gids = _ids(entry.get("uids", []), f"{where}: uids"), _ids(entry.get("gids", []), f"{where}: gids")
        for uid in uids:
            if uid in seen_uids:
                raise TenantConfigError(f"{where}: uid {uid} is in tenant {seen_uids[uid]} already")
            seen_uids[uid] = name
        token = None
        if "token_file" in entry:
            try:
                token = defaults.read_token(str(entry["token_file"]))
            except ValueError as e:
                raise TenantConfigError(f"{where}: {e}") from None
        admin = entry.get("admin", False)
        if not isinstance(admin, bool):
            raise TenantConfigError(f"{where}: admin must be true or false")
        cert_names = entry.get("cert_names", [])
        if not isinstance(cert_names, list) or not all(isinstance(n, str) and n for n in cert_names):
            raise TenantConfigError(f"{where}: cert_names must be a list of certificate names")
        quota = entry.get("quota")
        if quota is not None:
            quota = str(quota)
            _quota_bytes(quota, 1, where)  # the format, before the pool's size is known
        secret, old_secrets = _remote_secrets(entry, where)
        specs.append(
            TenantSpec(name, frozenset(uids), frozenset(gids), token, share, admin, quota, frozenset(cert_names),
                       secret, old_secrets)
        )
    tokens = [s.token for s in specs if s.token is not None]
    if len(tokens) != len(set(tokens)):
        raise TenantConfigError(f"{source}: two tenants have the same token")
    tenant_names = {s.name for s in specs}
    for spec in specs:
        if spec.share is not None and spec.share in tenant_names and spec.share != spec.name:
            raise TenantConfigError(
                f"{source}: tenant {spec.name} shares {spec.share!r}, which is another tenant's name; "
                "name a sharing group that no tenant has"
            )
    names = [n for s in specs for n in s.cert_names]
    if len(names) != len(set(names)):
        raise TenantConfigError(f"{source}: a certificate name is given to two tenants")
    return specs


def _remote_secrets(entry: dict, where: str) -> tuple[bytes | None, tuple[bytes, ...]]:
    old_files = entry.get("remote_old_secret_files", [])
    if not isinstance(old_files, list) or not all(isinstance(p, str) and p for p in old_files):
        raise TenantConfigError(f"{where}: remote_old_secret_files must be a list of files")
    if "remote_secret_file" not in entry:
        if old_files:
            raise TenantConfigError(f"{where}: remote_old_secret_files needs remote_secret_file (the new secret)")
        return None, ()
    path = entry["remote_secret_file"]
    if not isinstance(path, str) or not path:
        raise TenantConfigError(f"{where}: remote_secret_file must be a file")
    return _read_secret(path, where), tuple(_read_secret(p, where) for p in old_files)


def _read_secret(path: str, where: str) -> bytes:
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
            mode = os.fstat(f.fileno()).st_mode
    except OSError as e:
        raise TenantConfigError(f"{where}: cannot read the remote secret file {path}: {e.strerror}") from None
    if mode & 0o004:
        # Not refused: container runtimes mount secrets 0644 by default, inside a
        # container only the daemon's processes see.
        log.warning("%s: the remote secret file %s is readable by every user of this machine, and whoever reads "
                    "it can write blocks the fleet serves: chmod 0600 it", where, path)
    if len(secret) < MIN_REMOTE_SECRET_BYTES:
        raise TenantConfigError(
            f"{where}: the remote secret in {path} has {len(secret)} bytes; it needs at least "
            f"{MIN_REMOTE_SECRET_BYTES} (e.g. head -c 32 /dev/urandom | base64 > {path})"
        )
    return secret


def scope_remote_secrets(specs: list[TenantSpec]) -> dict[str, tuple[bytes, tuple[bytes, ...]]]:
    """Each scope's remote secrets (current, old): tenants of one sharing group
    seal and check one scope's values, so they must give the same secrets (or
    one of them gives them)."""
    return _per_scope(specs, lambda s: None if s.remote_secret is None else (s.remote_secret, s.remote_old_secrets),
                      "remote secrets")


def scope_quotas(specs: list[TenantSpec], pool_bytes: int, slot_bytes: int) -> dict[str, int]:
    """Each scope's quota in slots. Tenants of one sharing group share one quota,
    so they must give the same one (or one of them gives it)."""
    def slots(spec: TenantSpec) -> int | None:
        if spec.quota is None:
            return None
        return max(1, _quota_bytes(spec.quota, pool_bytes, f"tenant {spec.name}") // slot_bytes)

    return _per_scope(specs, slots, "quotas")


def _per_scope(specs: list[TenantSpec], value_of, what: str) -> dict:
    """{scope: value} of the tenants that give one (`value_of` None: not given);
    TenantConfigError when two tenants of one scope give different values."""
    given: dict[str, tuple[str, object]] = {}
    for spec in specs:
        value = value_of(spec)
        if value is None:
            continue
        known = given.get(spec.scope)
        if known is not None and known[1] != value:
            raise TenantConfigError(
                f"tenants {known[0]} and {spec.name} share {spec.scope} but give it different {what}"
            )
        given[spec.scope] = (spec.name, value)
    return {scope: value for scope, (_, value) in given.items()}


def _quota_bytes(text: str, pool_bytes: int, where: str) -> int:
    match = _QUOTA.fullmatch(text)
    if match:
        percent = float(match.group(1))
        if not 0 < percent <= 100:
            raise TenantConfigError(f"{where}: quota {text!r} must be more than 0% and at most 100%")
        return int(pool_bytes * percent / 100)
    try:
        size = parse_size(text)
    except ValueError:
        raise TenantConfigError(f"{where}: quota {text!r} is neither a percentage nor a size like 16GiB") from None
    if size <= 0:
        raise TenantConfigError(f"{where}: quota {text!r} must be more than 0")
    return min(size, pool_bytes)


def _ids(value, where: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32 for v in value
    ):
        raise TenantConfigError(f"{where} must be a list of ids (0 to 4294967295)")
    return value
