"""One tool call's JSON object, `{"name": ..., "arguments": {...}}`, read as it is generated, so that a call's name and
its arguments' text go out while the model still writes them (chat/tools.py turns them into deltas).

`CallReader` follows the object's members: `name` (a JSON string, which must name one of the request's tools), the
arguments (`arguments`, or `parameters` as Llama 3 writes them: an object, whose text as written is the call's
arguments; or a JSON string holding that text, as some models write it, decoded as it comes) and any other member
(skipped). The call is *decided* once its name is read and its arguments have begun (an object's opening brace, or a
string whose text has begun with one), in either order, or when the object closes with a name and no arguments
(arguments `{}`). From then on it is a call whatever follows: its arguments are the text written up to their closing
brace, or up to where the caller ends the call (a closing tag, the output's end). Inside the arguments the reader
tracks strings and nesting only, not JSON's syntax, so what a model writes there stays its arguments as written; a
call whose arguments close is valid JSON exactly when the model wrote valid JSON (a grammar-constrained call always).
Arguments written as a string are its text decoded a piece at a time: an escape sequence that a piece cuts (a
surrogate pair whole) waits for the next piece.

Before the decision, anything that is not such an object (no opening brace, a key without its colon, a name that is
no tool, arguments that are neither an object nor a string holding one) makes it *not a call*: the reader stops
there (`ended`, not `decided`) and the caller gives the text it read (`raw`) back as content.
"""

import json

WHITESPACE = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")


class CallReader:
    """Reads one call object from its opening brace (whitespace before it is skipped), a piece of text at a time."""

    def __init__(self, names: frozenset[str]) -> None:
        self._names = names
        # open (before the brace), key, colon, value, after (a member read), string, nested, scalar
        self._state = "open"
        # what the string or nested value being read is: key, name, arguments (an object), arguments_text (a string)
        # or skip (another member's value)
        self._purpose = ""
        self._value: list[str] = []  # the text of the key or name being read
        self._undecoded = ""  # string arguments' text read and not yet decoded: an escape sequence cut short
        self._leading = ""  # string arguments' decoded whitespace before their opening brace
        self._key = ""  # the member whose value comes next
        self._escaped = False  # the last character read inside a string was an unescaped backslash
        self._in_string = False  # inside a string within a nested value
        self._depth = 0  # nesting inside a nested value
        self.name: str | None = None
        self._unsent: list[str] = []  # the arguments' text read and not yet taken
        self._has_arguments = False
        self._raw: list[str] = []  # the text read while the call is undecided
        self.decided = False
        self.ended = False  # the object has closed, or what came cannot continue it

    def feed(self, text: str) -> int:
        """Read `text` until the object ends; returns how much of it was read (the rest is not the object's)."""
        at = 0
        while at < len(text) and not self.ended:
            if self._state in ("string", "nested"):
                at = self._read_value(text, at)
                continue
            char = text[at]
            if char in WHITESPACE and self._state != "scalar":
                at += 1
                continue
            if not self._step(char):
                self.ended = True
                break
            at += 1
        if not self.decided:
            self._raw.append(text[:at])
        return at

    @property
    def raw(self) -> str:
        """The text read while the call was undecided: all of it, for a call that is not one."""
        return "".join(self._raw)

    def take(self) -> str:
        """The arguments' text read since the last take."""
        text = "".join(self._unsent)
        self._unsent.clear()
        return text

    def _step(self, char: str) -> bool:
        """One character outside strings and nested values; False when it cannot continue the object (unread)."""
        state = self._state
        if state == "open" and char == "{":
            self._state = "key"
        elif state in ("key", "after") and char == "}":
            self._close()
        elif state == "key" and char == '"':
            self._begin("string", "key")
        elif state == "colon" and char == ":":
            self._state = "value"
        elif state == "after" and char == ",":
            self._state = "key"
        elif state == "value":
            return self._begin_value(char)
        elif state == "scalar":  # a number, true, false or null: it ends where the member does
            if char in WHITESPACE or char in ",}":
                self._state = "after"
                return char in WHITESPACE or self._step(char)
        else:
            return False
        return True

    def _begin_value(self, char: str) -> bool:
        if self._key == "name" and self.name is None:
            if char != '"':
                return False
            self._begin("string", "name")
        elif self._key in ARGUMENT_KEYS and not self._has_arguments:
            if char == "{":
                self._has_arguments = True
                self._begin("nested", "arguments")
                self._unsent.append(char)
                self._decide()
            elif char == '"':
                self._begin("string", "arguments_text")
            else:
                return False
        elif char == '"':
            self._begin("string", "skip")
        elif char in "{[":
            self._begin("nested", "skip")
        else:
            self._state = "scalar"
        return True

    def _begin(self, state: str, purpose: str) -> None:
        self._state, self._purpose, self._value = state, purpose, []
        self._escaped, self._in_string, self._depth = False, False, 1

    def _read_value(self, text: str, at: int) -> int:
        """Read a string or a nested value on from `at`; returns where reading stopped."""
        start, end = at, None
        while at < len(text):
            char = text[at]
            at += 1
            if self._escaped:
                self._escaped = False
            elif char == "\\" and (self._state == "string" or self._in_string):
                self._escaped = True
            elif char == '"' and self._state == "string":
                end = at
                break
            elif char == '"':
                self._in_string = not self._in_string
            elif self._in_string:
                continue
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = at
                    break
        if self._purpose == "arguments":
            self._unsent.append(text[start:at])
        elif self._purpose == "arguments_text":
            if not self._string_arguments(text[start : at - 1 if end is not None else at], end is not None):
                self.ended = True
                return at
        elif self._purpose != "skip":
            self._value.append(text[start:at])
        if end is not None:
            self._state = "after"
            if not self._value_read():
                self.ended = True
        return at

    def _value_read(self) -> bool:
        """A key, name, string or nested value has been read whole; False when it ends the object as not a call."""
        if self._purpose in ("skip", "arguments"):
            return True
        if self._purpose == "arguments_text":  # its text has gone to the arguments as it came
            return self._has_arguments
        try:
            value = json.loads('"' + "".join(self._value))
        except ValueError:
            return False
        if self._purpose == "key":
            self._key, self._state = value, "colon"
        else:
            if value not in self._names:
                return False
            self.name = value
        self._decide()
        return True

    def _string_arguments(self, raw: str, closed: bool) -> bool:
        """Arguments written as a JSON string: `raw`, the next of its text as written (up to its closing quote when
        `closed`), decoded to the arguments as far as whole escape sequences go. False when the string's text does not
        begin an object, or cannot be decoded before it has: not a call."""
        pending = self._undecoded + raw
        cut = len(pending) if closed else _decodable(pending)
        part, self._undecoded = pending[:cut], pending[cut:]
        try:
            text = json.loads('"' + part + '"')
        except ValueError:
            if not self._has_arguments:
                return False
            text = part  # not JSON's escapes: the arguments as written
        if self._has_arguments:
            self._unsent.append(text)
            return True
        self._leading += text
        begun = self._leading.lstrip(WHITESPACE)
        if not begun:
            return True
        if not begun.startswith("{"):
            return False
        self._has_arguments = True
        self._unsent.append(self._leading)
        self._decide()
        return True

    def _close(self) -> None:
        if self.name is not None and not self._has_arguments:
            self._unsent.append("{}")
            self._has_arguments = True
        self._decide()
        self.ended = True

    def _decide(self) -> None:
        self.decided = self.decided or (self.name is not None and self._has_arguments)


def _decodable(text: str) -> int:
    """How much of a JSON string's text (as written, without quotes) ends outside an escape sequence: `\\uD83D`
    waits for the low half of its surrogate pair."""
    at = end = 0
    while at < len(text):
        if text[at] != "\\":
            at += 1
        elif text[at + 1 : at + 2] != "u":
            at += 2
        elif at + 6 > len(text):
            break
        else:
            high = text[at + 2 : at + 4].lower() in ("d8", "d9", "da", "db")
            at += 6
            rest = text[at : at + 6]
            if high and (rest.startswith("\\u") or "\\u".startswith(rest)):
                if len(rest) < 6:
                    break
                at += 6
        if at > len(text):
            break
        end = at
    return end
