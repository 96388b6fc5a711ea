"""A model folder built once, whole, even when several processes ask for it at the same time
(pytest-xdist workers, engine processes side by side): each builder writes into a private temporary
folder beside the target and renames it into place, so a reader never sees half-written weights."""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable


def build_once(out: str, ready: Callable[[str], bool], make: Callable[[str], None]) -> str:
    """out if ready(out); else make(tmp) into a fresh folder beside it, renamed to out. A folder
    that another process published first wins (ours is discarded); one that is not ready (an older
    version, a build of before this function) is replaced."""
    if ready(out):
        return out
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}-", dir=parent)
    try:
        make(tmp)
        try:
            os.rename(tmp, out)                  # atomic; fails when out exists and is not empty
        except OSError:
            if ready(out):                       # another process published it meanwhile
                return out
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}-old-", dir=parent)
            os.rename(out, os.path.join(old, "x"))
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
