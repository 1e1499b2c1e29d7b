"""Reads the ``<!-- example: NAME -->`` blocks of docs/protocol.md as bytes."""
from __future__ import annotations

import os
import re
from typing import Dict

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "protocol.md")


def doc_examples() -> Dict[str, bytes]:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    out: Dict[str, bytes] = {}
    for m in re.finditer(r"<!-- example: (\w+) -->\s*```text\n(.*?)```", text, re.S):
        hexes = []
        for line in m.group(2).splitlines():
            hexes.append(line.split("#", 1)[0])
        out[m.group(1)] = bytes.fromhex(" ".join(hexes))
    return out
