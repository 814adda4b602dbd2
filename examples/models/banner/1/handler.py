"""A speech-bubble banner around the request's text (pure Python, no numpy).

::

     ________________
    < hello, fleet! >
     ----------------
       \\
        \\   [o_o]
            /|___|\\
              d b

Text is wrapped at ``WIDTH`` columns (existing line breaks are kept); wide
characters (CJK, most emoji) count as two columns so the bubble stays aligned.
"""

from __future__ import annotations

import textwrap
import unicodedata

from modelfleet import InvalidInput, Model, Output, Request

WIDTH = 40
MAX_CHARS = 4000

ROBOT = r"""   \
    \   [o_o]
       /|___|\
         d b"""


def display_width(text: str) -> int:
    """Terminal columns ``text`` takes: wide characters 2, combining marks 0."""
    width = 0
    for ch in text:
        if unicodedata.combining(ch):
            continue
        width += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return width


def wrap(text: str, width: int = WIDTH) -> list[str]:
    lines: list[str] = []
    for paragraph in text.expandtabs(4).splitlines():
        lines.extend(textwrap.wrap(paragraph, width, break_on_hyphens=False) or [""])
    while lines and not lines[-1]:
        lines.pop()
    return lines


def banner(text: str, width: int = WIDTH) -> str:
    """The banner for ``text``: a bubble of wrapped lines above the robot."""
    lines = wrap(text, width)
    inner = max(display_width(line) for line in lines)
    padded = [line + " " * (inner - display_width(line)) for line in lines]
    if len(padded) == 1:
        body = [f"< {padded[0]} >"]
    else:
        body = [f"{left} {line} {right}" for line, (left, right) in zip(
            padded, [("/", "\\")] + [("|", "|")] * (len(padded) - 2) + [("\\", "/")],
            strict=True)]
    top, bottom = " " + "_" * (inner + 2), " " + "-" * (inner + 2)
    return "\n".join([top, *body, bottom, ROBOT]) + "\n"


class Banner(Model):
    async def preprocess(self, request: Request) -> str:
        text = request.text()
        # Control characters would break the art (and a terminal); tabs and newlines stay.
        text = "".join(ch for ch in text if ch in "\t\n" or unicodedata.category(ch) != "Cc")
        if not text.strip():
            raise InvalidInput("empty text: send the words to put in the banner as text/plain")
        if len(text) > MAX_CHARS:
            raise InvalidInput(f"text is {len(text)} characters; the limit is {MAX_CHARS}")
        return text

    def predict(self, batch: list[str]) -> list[str]:
        return [banner(text) for text in batch]

    async def postprocess(self, output: str, request: Request) -> Output:
        return Output(output.encode("utf-8"), "text/plain; charset=utf-8")
