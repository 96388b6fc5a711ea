"""On/off A/B knobs read from the environment (``HISPARSE_*=0|1``): anything else is refused with a
one-line error naming the variable and what each value does. At the bottom of the package's
layers (it imports nothing of ours), so ``ops`` and ``core`` both read their knobs through it."""
from __future__ import annotations

import os


def env_flag(name: str, default: bool, on: str, off: str) -> bool:
    """The knob ``name`` (unset: ``default``); on / off: what 1 and 0 do, for the error."""
    v = os.environ.get(name, "1" if default else "0")
    if v not in ("0", "1"):
        raise ValueError(f"{name}={v!r}: use 1 ({on}{', the default' if default else ''}) or 0 "
                         f"({off}{'' if default else ', the default'})")
    return v == "1"
