"""Where the router sends each request, in the shape of the Gateway API inference extension's endpoint picker:
filters, scorers and a picker, named together as profiles (`spec.router.strategy`). Typed and without I/O: the
dispatcher (router/dispatch.py) calls it with the engines it may use. Design, and how to add a scorer:
docs/routing.md#the-scheduling-framework.
"""

from tensorfleet.router.scheduling.filters import KV_HIGH_WATER, has_room
from tensorfleet.router.scheduling.hashing import (
    CHARS_PER_TOKEN,
    PREFIX_BLOCK_CHARS,
    PREFIX_MAX_BLOCKS,
    block_chars,
    hash_prompt,
    prefix_hashes,
)
from tensorfleet.router.scheduling.profiles import HOME_SLACK_CHARS, PROFILES, CacheAware, Profile, make_profile
from tensorfleet.router.scheduling.request import RequestInfo, exposure

__all__ = ["CHARS_PER_TOKEN", "HOME_SLACK_CHARS", "KV_HIGH_WATER", "PREFIX_BLOCK_CHARS", "PREFIX_MAX_BLOCKS",
           "PROFILES", "CacheAware", "Profile", "RequestInfo", "block_chars", "exposure", "has_room",
           "hash_prompt", "make_profile", "prefix_hashes"]
