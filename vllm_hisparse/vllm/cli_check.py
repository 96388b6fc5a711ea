"""Bad hisparse input on a vLLM command line ends in one line and exit code 2 (argparse's code for
bad arguments), checked before the engine starts where it can be. plugin.py's wrap of
``FlexibleArgumentParser.parse_args`` (patches/README.md) calls, in order:

* ``check_argv(args)``, before vLLM parses: an ``--additional-config`` that names hisparse (or
  goes with ``--hisparse-config``) and is not valid JSON (vLLM's own message never says hisparse);
* ``check_namespace(ns)``, after it parses, only when the run selects hisparse: the negative
  control's knob (core/page_table.py) is off, the hisparse config loads and validates, the serving runtime implements it, and its host pool is not larger
  than the machine's RAM (or container limit). It then guards ``ns.dispatch_function`` (what
  ``vllm serve`` runs): a hisparse error raised later while vLLM builds its config in this process
  (the model-dependent checks of setup_check.py, which reach the top wrapped in pydantic's
  ValidationError) prints its own line instead of a 60-line traceback.

Errors raised in the engine's own processes (pinning the host pool, the GPU reservations) still
come with vLLM's tracebacks: the front-end only learns that the engine failed. An engine-side check
that ``report``s its message before raising (kv_room.py: the DSA latent pool leaving vLLM no KV
cache) reaches the user as one line and exit 2 all the same: ``check_namespace`` names a file in
``$HISPARSE_ENGINE_ERROR_FILE``, which the engine's processes inherit, and ``guard`` prints what
was reported there when the engine's start fails.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

from vllm_hisparse.config import GIB, HiSparseConfig, HiSparseConfigError

EXIT_CODE = 2
_ADDITIONAL = ("--additional-config", "--additional_config")
ENGINE_ERROR_ENV = "HISPARSE_ENGINE_ERROR_FILE"


def fail(message: str):
    """Print one line to stderr and exit 2 (no traceback)."""
    sys.stderr.write(message.replace("\n", " ") + "\n")
    sys.stderr.flush()
    raise SystemExit(EXIT_CODE)


def _values(args: list[str], flags: tuple[str, ...]) -> list[str]:
    out = []
    for i, a in enumerate(args):
        for f in flags:
            if a == f and i + 1 < len(args):
                out.append(args[i + 1])
            elif a.startswith(f + "="):
                out.append(a[len(f) + 1:])
    return out


def check_argv(args: list[str]) -> None:
    """An inline ``--additional-config`` JSON with a typo, when it concerns hisparse."""
    with_flag = any(a == "--hisparse-config" or a.startswith("--hisparse-config=") for a in args)
    if args and args[-1] == "--hisparse-config":
        fail("hisparse config: --hisparse-config has no value: give the path of a JSON file of "
             "hisparse settings")
    for val in _values(args, _ADDITIONAL):
        if not (with_flag or "hisparse" in val):
            continue
        try:
            json.loads(val)
        except ValueError as e:
            fail(f"hisparse config: --additional-config={val!r} is not valid JSON ({e}); fix it, or "
                 f"put the hisparse settings in a file and pass --hisparse-config FILE.json")


def selected(ns) -> bool:
    """The parsed command line picks the hisparse backend (``--attention-backend hisparse`` or
    ``--attention-config '{"backend": "hisparse"}'``)."""
    be = getattr(ns, "attention_backend", None)
    ac = getattr(ns, "attention_config", None)
    if be is None and isinstance(ac, dict):
        be = ac.get("backend")
    return str(getattr(be, "name", be)).lower() == "hisparse"


def load_config(ns) -> HiSparseConfig:
    extra = getattr(ns, "additional_config", None) or {}
    return HiSparseConfig.load(extra.get("hisparse") if isinstance(extra, dict) else None)


def check_host_ram(cfg: HiSparseConfig, mem: dict[str, int]) -> None:
    """A host pool larger than the machine's RAM (or the container's memory limit) can never be
    allocated; left alone, it fails in the engine's worker a minute later. ``mem``:
    core.host_pool.host_memory()."""
    from vllm_hisparse.core.host_pool import SUGGEST_SHARE

    if not cfg.host_tier:
        return
    caps = {k: mem[k] for k in ("total", "limit") if k in mem}
    if not caps or cfg.host_pool_bytes <= min(caps.values()):
        return
    key = min(caps, key=caps.get)
    what = "the container's memory limit" if key == "limit" else "this machine's RAM"
    free = [mem[k] for k in ("available", "limit") if k in mem]
    room = min(free, default=caps[key])
    of = f"the {room / GIB:.1f} GiB available now" if free else "it"
    fix = (f"use at most about {SUGGEST_SHARE * room / GIB:.1f} ({SUGGEST_SHARE:.0%} of {of})"
           if room > 0 else "free host memory first")
    fail(f"hisparse config: host_pool_gib={cfg.host_pool_gib!r} is invalid: more than {what} "
         f"({caps[key] / GIB:.1f} GiB); {fix}")


def hisparse_error(exc: BaseException) -> str | None:
    """The message of a hisparse configuration error inside ``exc`` (itself, its cause or context,
    or the errors of a pydantic ValidationError raised while vLLM builds its config)."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, HiSparseConfigError):
            return str(e)
        errors = getattr(e, "errors", None)             # pydantic.ValidationError, duck-typed
        if callable(errors):
            try:
                todo += [d.get("ctx", {}).get("error") for d in errors()]
            except Exception:                           # any other .errors(): not ours to read
                pass
        todo += [e.__cause__, e.__context__]
    return None


def report(message: str) -> None:
    """In an engine process, before raising a hisparse error: leave its line for the front end's
    ``guard`` (nothing when no front end asked, e.g. an ``LLM`` in a script)."""
    path = os.environ.get(ENGINE_ERROR_ENV)
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(message.replace("\n", " "))
    except OSError:                     # the error is raised all the same, with its traceback
        pass


def refuse(message: str):
    """An engine-side hisparse check that fails: ``report`` its line, then raise it
    (HiSparseConfigError) — one line and exit 2 under ``vllm serve``, the error in a script."""
    report(message)
    raise HiSparseConfigError(message)


def engine_error() -> str | None:
    """The line an engine process ``report``ed (read once: the file is removed)."""
    path = os.environ.get(ENGINE_ERROR_ENV)
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            msg = f.read().strip()
        os.remove(path)
    except OSError:
        return None
    return msg or None


def expect_engine_errors() -> None:
    """Name this front end's file for ``report`` (engine processes inherit the environment)."""
    path = os.path.join(tempfile.gettempdir(), f"hisparse-engine-error-{os.getpid()}.txt")
    if os.path.exists(path):            # a previous process of the same pid
        os.remove(path)
    os.environ[ENGINE_ERROR_ENV] = path


def guard(fn):
    """``fn`` with hisparse configuration errors turned into one line and exit 2."""
    def guarded(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            msg = hisparse_error(e) or engine_error()
            if msg is None:
                raise
            fail(msg)

    guarded._hisparse = True
    return guarded


def check_namespace(ns):
    """After vLLM parsed the command line: the checks that need no model; returns ``ns``."""
    if not selected(ns):
        return ns
    from vllm_hisparse.core.host_pool import host_memory
    from vllm_hisparse.core.latent_shadow import SHADOW_ENV, shadow_on
    from vllm_hisparse.core.page_table import CORRUPT_FETCH_ENV, corrupt_fetch

    from .setup_check import check_served

    try:
        control, shadow = corrupt_fetch(), shadow_on()
    except ValueError as e:
        fail(str(e))
    if control:
        fail(f"{CORRUPT_FETCH_ENV}=1 is the exactness harnesses' negative control (every page "
             f"fetched from the host pool is the wrong one): vllm serve refuses it; unset it")
    if shadow:
        fail(f"{SHADOW_ENV}=1 is the DSA exactness check's resident twin (test-only: its own "
             f"full-length regions): vllm serve refuses it; unset it")
    try:
        cfg = load_config(ns)
        check_served(cfg)
    except HiSparseConfigError as e:
        fail(str(e))
    check_host_ram(cfg, host_memory())
    fn = getattr(ns, "dispatch_function", None)
    if fn is not None and not getattr(fn, "_hisparse", False):
        expect_engine_errors()
        ns.dispatch_function = guard(fn)
    return ns
