"""Read docker/Dockerfile and replay its build without a Docker engine: the GPU box has none, and
no registry (its vLLM comes as a bundle in /tmp/site, standing in for the base image).

    python3 scripts/dockerfile_replay.py docker/Dockerfile --root /tmp/hisparse-image \
        [--build-arg MAX_JOBS=16] [--env HISPARSE_PIP_TARGET=/tmp/site] [--no-run]

Every absolute image path is placed under --root (WORKDIR /opt/x -> ROOT/opt/x). ARG and ENV set
the environment of each RUN, which runs with bash in its WORKDIR; COPY copies from the build
context (the repo) honouring .dockerignore; FROM, EXPOSE and the like are recorded, not acted on.
Writes ROOT/replay.json: base image, ENV, WORKDIR and ENTRYPOINT (its path under ROOT), and each
step's outcome; exits 1 at the first failing step. tests/test_docker.py uses ``parse`` and
``ignored`` to check the Dockerfile against the tree.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Step:
    op: str          # upper case: FROM, ARG, ENV, WORKDIR, COPY, RUN, ENTRYPOINT, ...
    args: str        # the rest, continuation lines joined
    line: int        # 1-based line of the instruction


def parse(path: str) -> list[Step]:
    steps, buf, start = [], "", 0
    with open(path) as f:
        for n, raw in enumerate(f, 1):
            line = raw.rstrip("\n")
            if not buf and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if buf and line.lstrip().startswith("#"):       # comments inside a continuation
                continue
            if not buf:
                start = n
            if line.endswith("\\"):
                buf += line[:-1] + " "
                continue
            buf += line
            op, _, rest = buf.strip().partition(" ")
            steps.append(Step(op.upper(), rest.strip(), start))
            buf = ""
    return steps


def exec_form(args: str) -> list[str] | None:
    """``["a", "b"]`` (exec form) as a list; None for the shell form."""
    return json.loads(args) if args.lstrip().startswith("[") else None


def substitute(s: str, env: dict[str, str]) -> str:
    """Docker's ${NAME}, ${NAME:-default} and $NAME in ENV / WORKDIR / COPY values."""
    def one(m):
        name, default = m.group(1) or m.group(3), m.group(2)
        return env.get(name) or (default if default is not None else env.get(name, ""))
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", lambda m: one(m), s)


def pairs(args: str, env: dict[str, str]) -> dict[str, str]:
    """ENV / ARG: ``A=1 B=2`` (or the legacy ``A 1``); ARG without a default gives ''."""
    if "=" not in args.split()[0]:
        name, _, value = args.partition(" ")
        return {name: substitute(value.strip(), env)}
    out = {}
    for word in re.findall(r'(?:[^\s"]|"[^"]*")+', args):
        name, _, value = word.partition("=")
        out[name] = substitute(value.strip('"'), {**env, **out})
    return out


def copy_args(args: str) -> tuple[list[str], str]:
    """(sources, destination) of a COPY (flags such as --chown dropped)."""
    words = exec_form(args) or args.split()
    words = [w for w in words if not w.startswith("--")]
    return words[:-1], words[-1]


def dockerignore(context: str) -> list[str]:
    path = os.path.join(context, ".dockerignore")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [p.strip().rstrip("/") for p in f if p.strip() and not p.lstrip().startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps ``rel`` (a path relative to the context) out of the context: a
    pattern matches the path or one of its parent folders; ``**/`` matches at any depth."""
    parts = rel.strip("/").split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for p in patterns:
        if p.startswith("!"):
            continue                                    # exceptions: not used by this repo
        tail = p[3:] if p.startswith("**/") else None
        for pre in prefixes:
            if fnmatch.fnmatchcase(pre, p) or (tail and fnmatch.fnmatchcase(pre.split("/")[-1], tail)):
                return True
    return False


def _copy(context: str, src: str, dest: str, patterns: list[str]) -> None:
    top = os.path.join(context, src)
    if not os.path.exists(top) or ignored(src, patterns):
        raise FileNotFoundError(f"COPY source {src} is not in the build context")
    if os.path.isfile(top):
        target = os.path.join(dest, os.path.basename(src)) if dest.endswith("/") else dest
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        shutil.copy2(top, target)
        return
    for d, dirs, files in os.walk(top):
        rel_d = os.path.relpath(d, context)
        dirs[:] = [x for x in dirs if not ignored(f"{rel_d}/{x}", patterns)]
        for x in files:
            rel = f"{rel_d}/{x}"
            if ignored(rel, patterns):
                continue
            target = os.path.join(dest, os.path.relpath(os.path.join(d, x), top))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(os.path.join(d, x), target)


def replay(dockerfile: str, root: str, context: str = REPO, build_args: dict | None = None,
           extra_env: dict | None = None, run: bool = True, log=print) -> dict:
    """Replay the Dockerfile under ``root``; returns (and writes to root/replay.json) what it did."""
    root = os.path.abspath(root)
    under = lambda p: os.path.join(root, p.lstrip("/"))                      # noqa: E731
    patterns = dockerignore(context)
    args, env, workdir = dict(build_args or {}), {}, "/"
    rec = {"from": None, "env": env, "workdir": "/", "entrypoint": None, "steps": [], "ok": True}
    for st in parse(dockerfile):
        t0, status = time.time(), "ok"
        try:
            if st.op == "FROM":
                rec["from"] = st.args.split()[0]
            elif st.op == "ARG":
                for k, v in pairs(st.args, {**args, **env}).items():
                    args.setdefault(k, v)
            elif st.op == "ENV":
                env.update(pairs(st.args, {**args, **env}))
            elif st.op == "WORKDIR":
                workdir = os.path.join(workdir, substitute(st.args, {**args, **env}))
                os.makedirs(under(workdir), exist_ok=True)
                rec["workdir"] = workdir
            elif st.op == "COPY":
                srcs, dest = copy_args(substitute(st.args, {**args, **env}))
                dest = under(os.path.join(workdir, dest)) + ("/" if dest.endswith("/") else "")
                for s in srcs:
                    _copy(context, s, dest, patterns)
            elif st.op == "RUN":
                if run:
                    cmd = exec_form(st.args) or ["bash", "-euo", "pipefail", "-c", st.args]
                    renv = {**os.environ, **args, **env, **(extra_env or {})}
                    r = subprocess.run(cmd, cwd=under(workdir), env=renv)
                    status = "ok" if r.returncode == 0 else f"exit {r.returncode}"
                else:
                    status = "not run"
            elif st.op in ("ENTRYPOINT", "CMD"):
                form = exec_form(st.args) or ["/bin/sh", "-c", st.args]
                rec[st.op.lower()] = [under(form[0]) if form[0].startswith("/") else form[0],
                                      *form[1:]]
            else:
                status = "recorded"
        except Exception as e:                                 # noqa: BLE001 - the step failed
            status = f"{type(e).__name__}: {e}"
        rec["steps"].append({"line": st.line, "op": st.op, "args": st.args[:200],
                             "status": status, "s": round(time.time() - t0, 1)})
        log(f"replay: line {st.line} {st.op} {st.args[:100]} -> {status} "
            f"({time.time() - t0:.1f} s)")
        if status not in ("ok", "not run", "recorded"):
            rec["ok"] = False
            break
    rec["workdir"] = under(rec["workdir"])
    with open(os.path.join(root, "replay.json"), "w") as f:
        json.dump(rec, f, indent=1)
    return rec


def _kv(items: list[str]) -> dict[str, str]:
    return dict(x.split("=", 1) for x in items)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dockerfile")
    p.add_argument("--root", required=True, help="where the image's absolute paths go")
    p.add_argument("--context", default=REPO)
    p.add_argument("--build-arg", action="append", default=[], help="NAME=VALUE")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for RUN steps only")
    p.add_argument("--no-run", action="store_true", help="copy, but do not run the RUN steps")
    a = p.parse_args(argv)
    os.makedirs(a.root, exist_ok=True)
    rec = replay(a.dockerfile, a.root, a.context, _kv(a.build_arg), _kv(a.env), not a.no_run)
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
