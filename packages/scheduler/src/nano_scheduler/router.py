"""Routing requests over data-parallel replicas. The server's fleet and nano-sim's both use
these objects, so a simulated fleet routes as the served one does.

A router keeps, per replica, the tokens routed to it and not done yet ("outstanding"): a
request adds its cost when routed (``request_cost``: the prompt to prefill and the most tokens
it may generate, per sequence), removes what the replica reports done as it streams
(``progress``), and the rest when it ends (``finish``). A replica that stops serving is taken
out (``remove``); routing then picks among the others.

Policies (``ROUTERS``, by name):

- ``least_tokens`` (default): the replica with the fewest outstanding tokens (of equals,
  the next in turn).
- ``prefix_aware``: the replica that last took the longest prefix of the prompt (the hash
  chain of its first full KV blocks, as the block manager hashes them), so that its prefix
  cache most likely holds it; unless that replica's load is over the least loaded one's by
  more than a bound (``max_imbalance`` relative, ``slack_tokens`` absolute): then the least
  loaded, which learns the prefix.
- ``round_robin``: each replica in turn.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import ClassVar

from nano_kvcache import BlockManager


class NoReplicaError(RuntimeError):
    """Every replica has stopped serving."""


def request_cost(prompt_len: int, n: int, max_tokens: int) -> int:
    """The tokens a request asks of a replica: each of its ``n`` sequences prefills the prompt
    and generates up to ``max_tokens``."""
    return n * (prompt_len + max_tokens)


class Router(ABC):
    """Chooses a replica for each request and follows the load it puts there."""

    name: ClassVar[str]
    reads_prompts: ClassVar[bool] = False  # whether ``_choose`` looks at the prompt's tokens

    def __init__(self, num_replicas: int, block_size: int = 16) -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_replicas, self.block_size = num_replicas, block_size
        self.outstanding = [0] * num_replicas  # tokens routed and not done, per replica
        self.serving = [True] * num_replicas
        self._routed: dict[Hashable, list[int]] = {}  # request -> [replica, tokens left]
        self._last = -1  # the replica chosen last

    def route(
        self,
        request: Hashable,
        prompt_token_ids: Sequence[int],
        cost: int,
        avoid: int | None = None,
    ) -> int:
        """The replica for ``request`` (a new key), charged ``cost`` tokens; never ``avoid``
        (a retry after that replica failed). ``NoReplicaError`` when none serves."""
        if request in self._routed:
            raise ValueError(f"request {request!r} is routed already")
        candidates = [r for r in range(self.num_replicas) if self.serving[r] and r != avoid]
        if not candidates:
            raise NoReplicaError(
                "no replica is serving"
                + ("" if avoid is None else f" besides replica {avoid}, which failed")
            )
        replica = self._last = self._choose(prompt_token_ids, candidates)
        self.outstanding[replica] += cost
        self._routed[request] = [replica, cost]
        return replica

    def progress(self, request: Hashable, tokens: int) -> None:
        """``tokens`` of ``request``'s cost are done (prefilled or generated)."""
        entry = self._routed.get(request)
        if entry is not None:
            done = min(tokens, entry[1])
            entry[1] -= done
            self.outstanding[entry[0]] -= done

    def finish(self, request: Hashable) -> None:
        """``request`` ended (finished, aborted or failed): its replica owes nothing more."""
        entry = self._routed.pop(request, None)
        if entry is not None:
            self.outstanding[entry[0]] -= entry[1]

    def remove(self, replica: int) -> None:
        """``replica`` stopped serving: nothing is routed to it from now on."""
        self.serving[replica] = False

    def replica_of(self, request: Hashable) -> int | None:
        entry = self._routed.get(request)
        return None if entry is None else entry[0]

    def least_loaded(self, candidates: list[int]) -> int:
        """The candidate with the fewest outstanding tokens; among equals, the next after the
        replica chosen last (an idle fleet takes requests in turn, not all on the first)."""
        outstanding = self.outstanding
        low = min(outstanding[r] for r in candidates)
        tied = [r for r in candidates if outstanding[r] == low]
        return next((r for r in tied if r > self._last), tied[0])

    @abstractmethod
    def _choose(self, prompt_token_ids: Sequence[int], candidates: list[int]) -> int:
        """One of ``candidates`` (serving replicas, in index order; never empty)."""


class LeastTokens(Router):
    name = "least_tokens"

    def _choose(self, prompt_token_ids: Sequence[int], candidates: list[int]) -> int:
        return self.least_loaded(candidates)


class RoundRobin(Router):
    name = "round_robin"

    def _choose(self, prompt_token_ids: Sequence[int], candidates: list[int]) -> int:
        return next((r for r in candidates if r > self._last), candidates[0])


class PrefixAware(Router):
    name = "prefix_aware"
    reads_prompts = True

    def __init__(
        self,
        num_replicas: int,
        block_size: int = 16,
        max_imbalance: float = 0.25,
        slack_tokens: int = 4096,
        max_blocks: int = 256,
        capacity: int = 1 << 17,
    ) -> None:
        """``max_imbalance``, ``slack_tokens``: how far over the least loaded replica's load
        the prefix's replica may be and still take it (the larger of the two bounds);
        ``max_blocks``: the prompt's first blocks hashed; ``capacity``: block hashes
        remembered (least recently routed forgotten first)."""
        super().__init__(num_replicas, block_size)
        if max_imbalance < 0 or slack_tokens < 0 or max_blocks < 1 or capacity < 1:
            raise ValueError(
                "max_imbalance and slack_tokens must be >= 0, max_blocks and capacity >= 1"
            )
        self.max_imbalance, self.slack_tokens = max_imbalance, slack_tokens
        self.max_blocks, self.capacity = max_blocks, capacity
        self._owner: OrderedDict[int, int] = OrderedDict()  # block hash -> replica

    def _choose(self, prompt_token_ids: Sequence[int], candidates: list[int]) -> int:
        hashes = self._hashes(prompt_token_ids)
        least = self.least_loaded(candidates)
        chosen = least
        for h in reversed(hashes):  # the longest prefix first
            owner = self._owner.get(h)
            if owner is not None and self.serving[owner] and owner in candidates:
                low = self.outstanding[least]
                bound = max(low * (1 + self.max_imbalance), low + self.slack_tokens)
                if self.outstanding[owner] <= bound:
                    chosen = owner
                break
        owners = self._owner
        for h in hashes:
            owners[h] = chosen
            owners.move_to_end(h)
        while len(owners) > self.capacity:
            owners.popitem(last=False)
        return chosen

    def _hashes(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The hash chain of the prompt's first full blocks (the last token excluded, as the
        block manager never caches the block holding it)."""
        size = self.block_size
        blocks = min((len(prompt_token_ids) - 1) // size, self.max_blocks)
        hashes, h = [], -1
        for b in range(blocks):
            h = BlockManager.compute_hash(list(prompt_token_ids[b * size : (b + 1) * size]), h)
            hashes.append(h)
        return hashes


ROUTERS: dict[str, type[Router]] = {cls.name: cls for cls in (LeastTokens, PrefixAware, RoundRobin)}


def make_router(name: str, num_replicas: int, block_size: int = 16) -> Router:
    """A router by policy name (``ROUTERS``)."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose one of {sorted(ROUTERS)}")
    return ROUTERS[name](num_replicas, block_size)
