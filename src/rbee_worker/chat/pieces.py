"""Text that arrives in pieces: a marker (a tag, a call's opening) may be split between two of them."""


def held_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (shorter than the marker): text that the next
    piece may complete into the marker, held back until it decides."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
