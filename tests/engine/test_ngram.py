"""Prompt lookup's proposals (engine/speculative/ngram.py): the longest suffix of min_n..max_n tokens found earlier,
its earliest occurrence, the tokens after it up to the limit."""

import random

import pytest

from rbee_worker.engine.speculative.ngram import propose


def reference(tokens: list[int], min_n: int, max_n: int, limit: int) -> tuple[int, ...]:
    """The same rule, written out over lists."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):  # occurrences that end before the last token
            if tokens[start : start + n] == suffix:
                return tuple(tokens[start + n : start + n + limit])
    return ()


def test_the_longest_suffix_found_earliest_proposes_what_followed_it() -> None:
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    assert propose(tokens, 1, 3, 4) == (4, 9, 2, 3)  # [1, 2, 3] at 0, not [2, 3] at 5
    assert propose(tokens, 1, 2, 2) == (4, 9)  # [2, 3], earliest at 1
    assert propose(tokens, 4, 4, 3) == ()  # [3, 1, 2, 3] occurs only as itself
    assert propose(tokens, 1, 3, 0) == ()
    assert propose([7, 7, 7, 7], 1, 2, 5) == (7, 7)  # what follows [7, 7] at 0, to the end


def test_ids_whose_bytes_match_across_tokens_are_not_matches() -> None:
    # 256 and 1 are bytes 00 01 00 00 and 01 00 00 00: [256, 1] holds the bytes of [1] at an odd offset
    assert propose([256, 1, 5, 1], 1, 1, 2) == (5, 1)
    assert propose([65536, 1, 1], 1, 1, 1) == (1,)
    assert propose([1 << 24, 0, 0, 1], 1, 1, 1) == ()


@pytest.mark.parametrize("seed", range(200))
def test_random_contexts_propose_what_the_written_out_rule_proposes(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 300, 70000])
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
    min_n = rng.randrange(1, 4)
    max_n = rng.randrange(min_n, 6)
    limit = rng.randrange(0, 6)
    assert propose(tokens, min_n, max_n, limit) == reference(tokens, min_n, max_n, limit)
