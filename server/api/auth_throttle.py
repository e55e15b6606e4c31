"""Wrong credentials on TCP, slowed per peer and logged now and then.

Without it anyone who can reach the port learns whether a guessed token is
right hundreds of times a second, and nothing tells the operator. A peer host
(its address without the port: a guesser opens as many connections as it
likes) gets a few wrong tries free, which a misconfigured client uses up at
once; after that each wrong answer comes later than the one before (doubling
up to MOST_DELAY_S), and a peer's wrong answers are spaced out in turn, so
that calls made at once do not guess faster. No answer waits more than
MAX_WAIT_S: beyond that many calls at once from one peer are bounded by the
transport's own limits on connections and streams. A right credential is
never slowed. The peers remembered are bounded (least recently failed
forgotten first) and forgotten after FORGET_AFTER_S without a failure.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

FREE_FAILURES = 5
FIRST_DELAY_S = 0.05
MOST_DELAY_S = 2.0
MAX_WAIT_S = 10.0
FORGET_AFTER_S = 300.0
MAX_PEERS = 4096


@dataclass
class _Peer:
    failures: int = 0
    last: float = 0.0
    # When the next wrong answer to this peer may go out at the earliest.
    next_answer: float = 0.0


class WrongCredentialThrottle:
    def __init__(self, clock=time.monotonic, max_peers: int = MAX_PEERS):
        self._clock = clock
        self._max_peers = max_peers
        self._peers: OrderedDict[str, _Peer] = OrderedDict()

    def failed(self, peer: str) -> tuple[float, int]:
        """A wrong credential from `peer` (gRPC's peer string): the seconds to
        wait before answering, and the peer's failures counted lately."""
        host = peer_host(peer)
        now = self._clock()
        state = self._peers.pop(host, None)
        if state is None or now - state.last > FORGET_AFTER_S:
            state = _Peer()
        self._peers[host] = state
        while len(self._peers) > self._max_peers:
            self._peers.popitem(last=False)
        state.failures += 1
        state.last = now
        if state.failures <= FREE_FAILURES:
            return 0.0, state.failures
        delay = min(MOST_DELAY_S, FIRST_DELAY_S * 2 ** (state.failures - FREE_FAILURES - 1))
        answer_at = max(now, state.next_answer) + delay
        if answer_at - now > MAX_WAIT_S:
            return MAX_WAIT_S, state.failures
        state.next_answer = answer_at
        return answer_at - now, state.failures

    @property
    def peers(self) -> int:
        return len(self._peers)


def peer_host(peer: str) -> str:
    """'ipv4:10.0.0.1:5000' -> 'ipv4:10.0.0.1', 'ipv6:[::1]:5000' -> 'ipv6:[::1]'."""
    family, sep, rest = peer.partition(":")
    if not sep or family not in ("ipv4", "ipv6"):
        return peer
    host, sep, port = rest.rpartition(":")
    return f"{family}:{host}" if sep and port.isdigit() else peer
