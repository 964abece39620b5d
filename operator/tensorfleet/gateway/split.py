"""Which InferenceService of a traffic group a request goes to: its conversation's key (the session header or `user`,
else the conversation's opening, else the prompt's head) and a weighted rendezvous hash of it over the members, so
every turn of a conversation, through any gateway replica, lands on the member its first turn did, each member takes
new conversations in proportion to its share, and a change of weights moves only the conversations it must. Design:
docs/gateway.md#traffic-groups-and-weights.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from tensorfleet import contract
from tensorfleet.prompts import opening, prompt_text

PROMPT_KEY_CHARS = 1024  # a prompt that is not a chat: its head is the key (a completions conversation repeats it)
_SCALE = float(1 << 64)


def conversation(headers: Mapping[str, str], body: Mapping[str, Any]) -> tuple[bytes | None, bool]:
    """The request's conversation key (None: nothing to keep it by, e.g. an embedding of nothing) and whether it
    opens its conversation (False for a later turn of a chat)."""
    session = headers.get(contract.SESSION_HEADER) or body.get("user")
    chat = opening(body)
    first = chat is None or not chat[1]
    if isinstance(session, str) and session:
        return b"s" + session.encode("utf-8", "surrogatepass"), first
    if chat is not None:
        text = chat[0]
    else:
        text = prompt_text(body)[:PROMPT_KEY_CHARS]
        if not text:
            return None, first
    return b"o" + text.encode("utf-8", "surrogatepass"), first


def pick(key: bytes | None, members: Sequence[tuple[str, float]], rng: random.Random | None = None) -> str | None:
    """The member KEY goes to among MEMBERS (name, share; those at 0 take none): the one with the highest
    share / -ln(u), u the key's uniform hash with the member, which a member wins with probability share / total.
    Without a key, a random member by share. None when no member has a share."""
    live = [(name, share) for name, share in members if share > 0]
    if not live:
        return None
    if key is None:
        return (rng or random).choices([name for name, _ in live], [share for _, share in live])[0]
    digest = hashlib.blake2b(key, digest_size=16).digest()
    best, best_score = live[0][0], -1.0
    for name, share in live:
        mixed = hashlib.blake2b(name.encode(), digest_size=8, key=digest).digest()
        u = (int.from_bytes(mixed, "big") + 0.5) / _SCALE
        score = share / -math.log(u)
        if score > best_score:
            best, best_score = name, score
    return best
