"""tensorfleet.prompts: what the router and the simulator agree a prompt is, and its block hashes."""

from __future__ import annotations

from typing import Any

from tensorfleet.prompts import ROLE_OPEN, block_hashes, content_text, prompt_text, render_chat
from tensorfleet.router.scheduling import PREFIX_BLOCK_CHARS, PREFIX_MAX_BLOCKS, prefix_hashes
from tensorfleet.sim.tokenizer import tokenize


def test_content_is_a_string_or_its_text_parts() -> None:
    assert content_text("hi") == "hi"
    assert content_text(None) == ""
    parts = [{"type": "text", "text": "look "}, {"type": "image_url", "image_url": {"url": "x"}}, {"text": "here"}]
    assert content_text(parts) == "look here"


def test_a_chat_renders_as_a_template_ending_with_the_assistant_header() -> None:
    text = render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert text.index("be brief") < text.index("hi")
    assert text.endswith(f"{ROLE_OPEN}assistant\n")


def test_the_router_and_the_simulator_see_the_same_chat_prompt() -> None:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    assert prompt_text(body) == render_chat(body["messages"])


def test_completion_prompts() -> None:
    assert prompt_text({"prompt": "once upon"}) == "once upon"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1 2 3"
    assert prompt_text({"prompt": [[1, 2], [3]]}) == "1 2"
    assert prompt_text({}) == ""


def test_hashes_are_chained_so_they_agree_exactly_as_long_as_the_prefix_does() -> None:
    shared = "a" * 300
    one, two = block_hashes(shared + "x" * 100, 100), block_hashes(shared + "y" * 100, 100)
    assert one[:3] == two[:3] and one[3] != two[3]
    # The same block after a different history hashes differently.
    assert block_hashes("b" * 100 + "a" * 100, 100)[1] != block_hashes("c" * 100 + "a" * 100, 100)[1]


def test_only_full_blocks_count_and_tokens_hash_like_characters() -> None:
    assert block_hashes("abc", 4) == []
    assert len(block_hashes("abcdefgh", 4)) == 2
    tokens = tokenize("the quick brown fox jumps over the lazy dog")
    assert len(block_hashes(tokens, 2)) == len(tokens) // 2


def test_the_router_hashes_at_most_its_block_budget() -> None:
    long = "z" * (PREFIX_BLOCK_CHARS * (PREFIX_MAX_BLOCKS + 10))
    assert len(prefix_hashes(long)) == PREFIX_MAX_BLOCKS
