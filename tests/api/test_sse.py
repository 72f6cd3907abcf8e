"""The SSE lines both streaming APIs write (api/native.py sse_data)."""

import json

from httpx._decoders import LineDecoder

from rbee_worker.api.native import sse_data


def test_generated_line_separators_cannot_split_a_data_line() -> None:
    """Text with NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR (tokens can decode to them) stays one `data:` line for
    clients that split lines like str.splitlines, httpx's iter_lines among them (CI once failed on a cut line), and
    decodes back to the same text; other non-ASCII text is sent as UTF-8."""
    text = "a\u2028b\x85c\u2029d é 蜂"
    event = sse_data({"type": "token", "t": text})
    lines = [line for line in LineDecoder().decode(event) if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0].removeprefix("data: "))["t"] == text
    assert "é 蜂" in event
