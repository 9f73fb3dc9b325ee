"""gpt-oss's harmony format: channels, ``<|channel|>commentary to=functions.NAME ... <|message|>{...}<|call|>``; the
``analysis`` channel is reasoning."""

from __future__ import annotations

import re

from leat.chatformat import Delta, OutputParser, add_content, call_from_object
from leat.textstream import find_first, held_prefix


class HarmonyParser(OutputParser):
    """gpt-oss output: messages ``[<|start|>assistant][ to=R]<|channel|>C[ to=R][ <|constrain|>json]<|message|>BODY``,
    each ended by ``<|end|>``, ``<|call|>``, ``<|return|>`` or the end of the output."""

    HEADER_END = "<|message|>"
    BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
    HEADER_START = ("<|start|>", "<|channel|>")
    always_parsed = True  # the channels are there, tools or not
    own_reasoning = True  # the analysis channel

    @classmethod
    def detect(cls, template: str, special: set[str], architecture: str) -> int | None:
        return 60 if "<|channel|>" in template or "<|channel|>" in special or architecture == "gpt-oss" else None

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "between"  # between messages | header | body
        self.header = ""
        self.channel = ""
        self.recipient: str | None = None
        self.body = ""

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        out: list[Delta] = []
        while self.buffer:
            if self.state == "between":
                at, marker = find_first(self.buffer, self.HEADER_START)
                if at < 0:
                    keep = held_prefix(self.buffer, self.HEADER_START)
                    # Text outside any message (a model that skipped its header) is content.
                    add_content(out, self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                add_content(out, self.buffer[:at])
                self.buffer = self.buffer[at:]
                self.state, self.header = "header", ""
            elif self.state == "header":
                at = self.buffer.find(self.HEADER_END)
                if at < 0:
                    break
                self._read_header(self.buffer[:at])
                self.buffer = self.buffer[at + len(self.HEADER_END) :]
                self.state, self.body = "body", ""
            else:
                at, marker = find_first(self.buffer, self.BODY_ENDS)
                piece = self.buffer if at < 0 else self.buffer[:at]
                if at < 0:
                    keep = held_prefix(self.buffer, self.BODY_ENDS)
                    piece = self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                else:
                    self.buffer = self.buffer[at + (0 if marker == "<|start|>" else len(marker)) :]
                out += self._body(piece)
                if at < 0:
                    break
                out += self._end_message()
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self.state == "body":
            out += self._body(self.buffer)
            out += self._end_message()
        elif self.buffer:
            add_content(out, self.buffer if self.state == "between" else "")
        self.buffer = ""
        return out

    def _read_header(self, header: str) -> None:
        header = header.replace("<|start|>", " ").replace("<|channel|>", " <|channel|>")
        recipient = re.search(r"to=([^\s<]+)", header)
        channel = re.search(r"<\|channel\|>\s*(\w+)", header)
        self.recipient = recipient.group(1) if recipient else None
        self.channel = channel.group(1) if channel else "final"

    def _body(self, piece: str) -> list[Delta]:
        if not piece:
            return []
        if self.recipient:
            self.body += piece
            return []
        return [Delta("reasoning" if self.channel == "analysis" else "content", piece)]

    def _end_message(self) -> list[Delta]:
        self.state = "between"
        if not self.recipient:
            return []
        name = self.recipient.removeprefix("functions.")
        body, self.body, self.recipient = self.body, "", None
        call = call_from_object({"name": name, "arguments": body.strip() or "{}"})
        return [Delta("tool_call", call=call)] if call else [Delta("content", body)]
