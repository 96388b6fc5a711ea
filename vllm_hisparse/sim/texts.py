"""Real long texts available offline: documents shipped by Debian packages.

Each source is ``name -> path``; ``load_text(name)`` returns the plain text (gzip and the info
format's control characters removed). Multi-part info manuals are concatenated in order.
"""
from __future__ import annotations

import glob
import gzip
import os
import re

SOURCES = {
    "gpl3": "/usr/share/common-licenses/GPL-3",
    "coreutils": "/usr/share/info/coreutils.info.gz",
    "gettext": "/usr/share/info/gettext.info.gz",
    "wget": "/usr/share/info/wget.info.gz",
    "gnupg": "/usr/share/info/gnupg.info-1.gz",
    "find": "/usr/share/info/find.info-1.gz",
    "sed": "/usr/share/info/sed.info.gz",
}


def available() -> list[str]:
    return [n for n, p in SOURCES.items() if os.path.exists(p)]


def load_text(name: str) -> str:
    """Plain text of a source name, or of a file path (gzip allowed)."""
    path = SOURCES.get(name, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"text source {name!r} not found; choose one of {', '.join(available())} "
                                f"or pass a file path")
    parts = [path]
    if path.endswith(".info-1.gz"):
        parts = sorted(glob.glob(path.replace("-1.gz", "-*.gz")))
    out = []
    for p in parts:
        opener = gzip.open if p.endswith(".gz") else open
        with opener(p, "rt", encoding="utf-8", errors="replace") as f:
            out.append(f.read())
    text = "".join(out)
    text = text.replace("\x1f", "\n").replace("\x7f", "")
    return re.sub(r"\n{3,}", "\n\n", text)
