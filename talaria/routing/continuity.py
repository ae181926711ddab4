"""Infer an agent session when the client sends no session id.

Agent clients rarely thread a session id, but their conversations grow by appending: call n+1
sends call n's messages, our reply (possibly edited by the client), and tool results. So a request
continues a session when its conversation extends a recent call's conversation on the same model,
with or without that call's output appended.

To stay cheap at 100,000 sessions and 100K-token prompts we never store messages or tokens, only
cumulative 64-bit hashes: `message_chain` gives one hash per message prefix (chat requests),
`token_chain` one per full page of prompt tokens (`/v1/completions`). After a call, the gateway
remembers two keys for its session — the request's last chain hash and that hash extended by our
reply — and a later request looks up its own chain from the longest prefix down.

Hashes are blake2b, never Python's `hash()`, so chains agree across processes and restarts.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from random import Random
from typing import Any

import numpy as np

Clock = Callable[[], float]

# The message fields that decide what a model sees; anything else a client echoes back (refusal,
# audio, SDK extras) must not change the hash.
CANONICAL_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")
DEFAULT_PAGE = 64  # tokens per block in token_chain; only whole blocks are hashed


def _root(label: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(label, digest_size=8).digest(), "little")


MESSAGE_ROOT = _root(b"talaria.continuity.messages.v1")
# A different root keeps token chains and message chains from ever sharing keys.
TOKEN_ROOT = _root(b"talaria.continuity.tokens.v1")


def _step(last: int, payload: bytes | memoryview) -> int:
    """h_k = blake2b-64(h_{k-1} as 8 little-endian bytes ++ payload)."""
    h = hashlib.blake2b(last.to_bytes(8, "little"), digest_size=8)
    h.update(payload)
    return int.from_bytes(h.digest(), "little")


def canonical(message: Mapping[str, Any]) -> bytes:
    """The bytes a message hashes as: its canonical fields as compact, key-sorted JSON.

    A field given as None counts as absent, because SDKs echo `"name": null` or `"content": null`
    for fields the original omitted. ASCII escapes keep lone surrogates (legal in JSON) encodable.
    """
    kept = {k: message[k] for k in CANONICAL_FIELDS if message.get(k) is not None}
    return json.dumps(kept, sort_keys=True, separators=(",", ":")).encode()


def namespaced(root: int, namespace: str | None) -> int:
    """`root` for the conversations of one namespace (a tenant and its cache salt): chains of
    different namespaces share no key, so no conversation is ever recognised across them."""
    return root if not namespace else _step(root, b"namespace:" + namespace.encode())


def extend_chain(last: int | None, message: Mapping[str, Any]) -> int:
    """One step of `message_chain`: the hash of the conversation `last` followed by `message`."""
    return _step(MESSAGE_ROOT if last is None else last, canonical(message))


def message_chain(messages: Sequence[Mapping[str, Any]], root: int | None = None) -> list[int]:
    """Cumulative hashes of a chat conversation, one per message: entry k covers messages[:k+1].
    `root`: a namespace's (`namespaced`), default MESSAGE_ROOT."""
    chain: list[int] = []
    last: int | None = root
    for m in messages:
        last = extend_chain(last, m)
        chain.append(last)
    return chain


def assistant_message(text: str) -> dict[str, Any]:
    """Our reply as a client appends it to the conversation, for the second remembered key."""
    return {"role": "assistant", "content": text}


def token_chain(token_ids: Sequence[int], page: int = DEFAULT_PAGE, after: int = TOKEN_ROOT) -> list[int]:
    """Cumulative hashes of the full `page`-token blocks of a prompt; a partial tail is ignored.

    Hashing whole pages only is what lets a prompt that extends prompt+output match even when the
    output ended mid-page: both agree on every full page they share. Tokens pack as little-endian
    int32, so 100K tokens hash in a few milliseconds. `after`: the chain's last hash so far, to
    extend a chain by the tokens after its last full page without hashing the rest again.
    """
    if page < 1:
        raise ValueError(f"token_chain page must be >= 1 token, got {page}")
    if len(token_ids) < page:
        return []
    data = memoryview(np.asarray(token_ids, dtype="<i4").tobytes())
    step = 4 * page
    chain: list[int] = []
    last = after
    for start in range(0, len(data) - step + 1, step):
        last = _step(last, data[start:start + step])
        chain.append(last)
    return chain


def new_session_id(rng: Random | None = None) -> str:
    """A fresh inferred-session id, "auto-" plus 16 hex digits; pass `rng` for deterministic tests."""
    if rng is None:
        return "auto-" + secrets.token_hex(8)
    return f"auto-{rng.getrandbits(64):016x}"


class ContinuityIndex:
    """Bounded map from conversation-chain hashes to the session they belong to (per model).

    Each (model, session) holds only the keys of its latest call, so memory is O(sessions) whatever
    the conversation length. Sessions live at most `ttl_s` after their last `remember` and at most
    `capacity` exist; both bounds evict from the front of `_sessions`, and evicting a session
    removes its keys.
    invariant: `_sessions` is sorted by last use, because `remember` moves its entry to the end and
    the clock is monotonic.
    invariant: a key in `_keys[model]` names exactly the one session in `_sessions` that lists it.
    """

    def __init__(self, clock: Clock, ttl_s: float = 900.0, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError(f"continuity index capacity must be >= 1 session, got {capacity}")
        if ttl_s <= 0:
            raise ValueError(f"continuity index ttl_s must be > 0 seconds, got {ttl_s}")
        self._clock = clock
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._keys: dict[str, dict[int, str]] = {}  # model -> chain hash -> session id
        # (model, session id) -> (its latest call's keys, when that call was remembered)
        self._sessions: OrderedDict[tuple[str, str], tuple[tuple[int, ...], float]] = OrderedDict()

    def lookup(self, model: str, chain: Sequence[int]) -> str | None:
        """The session whose remembered key is the longest prefix of `chain` on `model`, if any."""
        self._expire(self._clock())
        keys = self._keys.get(model)
        if not keys:
            return None
        for h in reversed(chain):
            session = keys.get(h)
            if session is not None:
                return session
        return None

    def remember(self, model: str, session_id: str, keys: Iterable[int]) -> None:
        """After a call on `model` finished: `session_id` now owns `keys`, replacing its older ones.

        A key another session owned moves to this one: the newest call sharing a prefix wins.
        """
        now = self._clock()
        sid = (model, session_id)
        self._drop(sid)
        kept = tuple(dict.fromkeys(keys))
        table = self._keys.setdefault(model, {})
        for h in kept:
            previous = table.get(h)
            if previous is not None:
                self._disown((model, previous), h)
            table[h] = session_id
        self._sessions[sid] = (kept, now)
        self._expire(now)
        while len(self._sessions) > self._capacity:
            self._drop(next(iter(self._sessions)))

    def __len__(self) -> int:
        """(model, session) pairs remembered."""
        return len(self._sessions)

    def _expire(self, now: float) -> None:
        while self._sessions:
            sid, (_, used_at) = next(iter(self._sessions.items()))
            if now - used_at <= self._ttl_s:
                return
            self._drop(sid)

    def _drop(self, sid: tuple[str, str]) -> None:
        """Forget a session and the keys it still owns."""
        entry = self._sessions.pop(sid, None)
        if entry is None:
            return
        model = sid[0]
        table = self._keys[model]
        for h in entry[0]:
            del table[h]  # ours by the invariant: `_disown` took back any key another session claimed
        if not table:
            del self._keys[model]

    def _disown(self, sid: tuple[str, str], h: int) -> None:
        """Take key `h` from session `sid` (another session's newer call now owns it)."""
        keys, used_at = self._sessions[sid]
        self._sessions[sid] = (tuple(k for k in keys if k != h), used_at)
