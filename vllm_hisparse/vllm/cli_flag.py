"""``--hisparse-config FILE.json``: shorthand for ``--attention-backend hisparse
--additional-config '{"hisparse": "FILE.json"}'`` on any vLLM command line (merged into an
``--additional-config`` that is already there). vLLM's parser has no plugin hook for new flags, so
``register()`` wraps ``FlexibleArgumentParser.parse_args`` with ``rewrite`` (pure, no vLLM)."""
from __future__ import annotations

import json
import os

FLAG = "--hisparse-config"


def _pop(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            val = args[i + 1]
            del args[i:i + 2]
            return val
        if a.startswith(flag + "="):
            del args[i]
            return a[len(flag) + 1:]
    return None


def rewrite(args: list[str]) -> list[str]:
    """Return args with ``--hisparse-config X`` turned into the long form; unchanged without it."""
    if not any(a == FLAG or a.startswith(FLAG + "=") for a in args):
        return args
    args = list(args)
    path = _pop(args, FLAG)
    src = os.path.abspath(path) if path and not path.lstrip().startswith("{") else path
    extra = _pop(args, "--additional-config") or _pop(args, "--additional_config")
    merged = json.loads(extra) if extra else {}
    merged["hisparse"] = src
    args += ["--additional-config", json.dumps(merged)]
    if not any(a == "--attention-backend" or a.startswith("--attention-backend=") for a in args):
        args += ["--attention-backend", "hisparse"]
    return args
