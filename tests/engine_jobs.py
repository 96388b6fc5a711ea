"""Engine processes side by side: what the engine tests share to start their vLLM CPU engines
(each in a process of its own) a few at a time instead of one after the other.

An engine process of the tiny model is one busy Python thread (its tensors are too small for
torch's intra-op threads), so on the 2-core CI machine two engines side by side take the wall time
of about one. Each engine still runs alone in its own process with the same settings and the same
requests as before, so its tokens and logprobs are what a run alone gives: only the wall clock is
shared. ``HISPARSE_TEST_ENGINES=1`` runs them one at a time (e.g. to read one engine's log).

``run_all`` starts a fresh process per engine; ``run_pooled`` (same jobs, same answers) runs each
in one of a few processes kept for the pytest session, which imported vLLM and made their first
engine once (most of a tiny engine's life), and ``run_script`` is the engine tests' driver on top
of it (a test file run as a script per tag, its JSON read back)."""
from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor


def width() -> int:
    """How many engine processes run at once: HISPARSE_TEST_ENGINES, else the cores this process
    may use (at most 4: each engine holds its own 1 GiB CPU KV cache)."""
    if os.environ.get("HISPARSE_TEST_ENGINES"):
        return max(1, int(os.environ["HISPARSE_TEST_ENGINES"]))
    return max(1, min(4, len(os.sched_getaffinity(0))))


def run_all(jobs: dict, timeout: float = 600) -> dict:
    """jobs: {name: (argv, env)}, started in the order given (put the longest first), ``width()``
    at a time. Returns {name: subprocess.CompletedProcess} (text stdout / stderr captured); a job
    past ``timeout`` seconds is killed and gets returncode -9 and "timed out" in its stderr, so
    that only the tests that read it fail."""
    def one(job):
        argv, env = job
        try:
            return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
            return subprocess.CompletedProcess(argv, -9, out or "",
                                               (err or "") + f"\ntimed out after {timeout} s")

    with ThreadPoolExecutor(max_workers=width()) as pool:
        futures = {name: pool.submit(one, job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


# ---------------------------------------------------------------------------------------------
# Engine processes kept for the session: the same jobs, each in a process that already imported
# vLLM and started an engine before.
#
# An engine process of the tiny model spends most of its life before its first step: importing
# vLLM (~8 s on 2 loaded cores) and the first engine start of a process (~20-30 s: one-time
# initialisation of torch's CPU kernels and vLLM's); a second engine in the same process starts in
# ~2 s. ``run_pooled`` runs each job's script (``[PY, script.py, args...]`` or
# ``[PY, "-m", module, args...]``) as ``__main__`` in one of ``width()`` processes kept for the
# whole pytest session, one job after another, with the job's own environment for its duration and
# its stdout and stderr (file descriptors 1 and 2) captured: an engine is made, serves the job's
# requests with the job's settings and is shut down (its KV connector and vLLM's distributed state
# torn down, so the next engine makes its own) before the next job starts. What vLLM reads from the
# environment once per process (import time) is the same for every job; the pool's processes start
# with NUMBA_DISABLE_JIT=1 (numba is imported by vLLM's ngram proposer only: plain-Python
# proposals, the same ones, without ~30 s of compilation per process).
# ---------------------------------------------------------------------------------------------

import atexit
import json
import queue
import shutil
import sys
import tempfile
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_pool: "queue.Queue | None" = None
_pool_lock = threading.Lock()


def read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


class _Server:
    """One kept process (this file run with ``--serve``): a job is one JSON line on its stdin,
    its answer one JSON line on its stdout."""

    def __init__(self):
        env = dict(os.environ, NUMBA_DISABLE_JIT="1")
        self.dir = tempfile.mkdtemp(prefix="hisparse-engines-")
        self.err = open(os.path.join(self.dir, "server.log"), "w")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, env=env, cwd=_ROOT)
        self.n = 0

    def run(self, argv, env, timeout) -> subprocess.CompletedProcess:
        self.n += 1
        out, err = (os.path.join(self.dir, f"job{self.n}.{s}") for s in ("out", "err"))
        self.proc.stdin.write(json.dumps({"argv": list(argv), "env": dict(env), "out": out,
                                          "err": err}) + "\n")
        self.proc.stdin.flush()
        answer: list = []
        reader = threading.Thread(target=lambda: answer.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout)
        if not answer or not answer[0]:
            self.proc.kill()
            self.proc.wait()
            why = f"\ntimed out after {timeout} s" if not answer else \
                f"\nengine process died:\n{read(self.err.name)[-4000:]}"
            r = subprocess.CompletedProcess(argv, -9, read(out), read(err) + why)
            self.close()
            return r
        r = subprocess.CompletedProcess(argv, json.loads(answer[0])["returncode"], read(out),
                                        read(err))
        for p in (out, err):
            os.remove(p)
        return r

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self):
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()
        self.proc.wait()
        self.err.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _servers() -> "queue.Queue":
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = queue.Queue()
            for _ in range(width()):
                _pool.put(None)                    # started on first use
            atexit.register(_close_all)
    return _pool


def _close_all():
    while _pool is not None and not _pool.empty():
        s = _pool.get_nowait()
        if s is not None and s.alive():
            s.close()


def run_pooled(jobs: dict, timeout: float = 600) -> dict:
    """``run_all``'s jobs and answers ({name: (argv, env)} -> {name: CompletedProcess}), each job
    run in one of the session's kept engine processes (above) instead of a fresh one: argv is
    ``[python, script.py, *args]`` or ``[python, "-m", module, *args]``, env the job's whole
    environment. A job past ``timeout`` seconds kills its process (a fresh one takes its place).
    What a job patches on vLLM's Scheduler or hisparse's HiSparseManager is put back after it; a
    job that patches any other class or module must patch instances instead (or undo it), since
    the process's next job runs with what it left (registries, e.g. indexers.register, stay)."""
    pool = _servers()

    def one(job):
        argv, env = job
        s = pool.get()
        try:
            if s is None or not s.alive():
                s = _Server()
            r = s.run(argv, env, timeout)
            if not s.alive():
                s = None
            return r
        finally:
            pool.put(s)

    with ThreadPoolExecutor(max_workers=width()) as ex:
        futures = {name: ex.submit(one, job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def _teardown(llms: list) -> None:
    """After a job: its engines shut down, and what vLLM keeps per process for one engine (the KV
    connector, the distributed groups, the frozen GC heap) released."""
    import gc

    for llm in llms:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
    llms.clear()
    try:
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
    except Exception:
        pass
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:
        pass
    gc.unfreeze()
    gc.collect()


def _serve() -> None:
    """The kept process: run each job of stdin as ``__main__``, answer its exit status."""
    import gc
    import runpy
    import traceback

    sys.path[:0] = [_HERE, os.path.join(_ROOT, "scripts")]
    answers = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)                         # between jobs: nothing reaches the answers
    base_env, base_argv, base_path = dict(os.environ), list(sys.argv), list(sys.path)
    import torch

    # vLLM's CPU worker replaces torch.set_num_threads with a no-op once it has bound threads, so
    # whatever one job's engine set would stay for every later job of this process: each job gets
    # its environment's OMP_NUM_THREADS (the suite's 1, tests/conftest.py) through the original
    # (a served engine and an offline one must compute alike: CPU sums depend on the thread count)
    set_threads = torch.set_num_threads
    from vllm import LLM                    # the one import of vLLM of this process

    llms: list = []
    orig_init = LLM.__init__

    def init(self, *a, **k):
        llms.append(self)
        orig_init(self, *a, **k)

    LLM.__init__ = init
    for line in sys.stdin:
        job = json.loads(line)
        from vllm.v1.core.sched.scheduler import Scheduler
        saved = {cls: dict(vars(cls)) for cls in _patched_classes(Scheduler)}
        sys.stdout.flush()
        sys.stderr.flush()
        fds = [os.open(job[k], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
               for k in ("out", "err")]
        keep_err = os.dup(2)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        os.environ.clear()
        os.environ.update(job["env"])
        set_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
        print(f"engine_jobs: torch threads {torch.get_num_threads()}", file=sys.stderr)
        rc = 0
        try:
            argv = job["argv"][1:]
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                sys.path[0:0] = [os.path.dirname(os.path.abspath(argv[0]))]
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            rc = 1
        try:
            _teardown(llms)
        except BaseException:
            traceback.print_exc()
        for cls, attrs in saved.items():         # what a job patched on vLLM's classes
            for k in set(vars(cls)) - set(attrs):
                delattr(cls, k)
            for k, v in attrs.items():
                if vars(cls).get(k) is not v:
                    setattr(cls, k, v)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(devnull, 1)
        os.dup2(keep_err, 2)
        os.close(keep_err)
        for fd in fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(base_env)
        sys.argv, sys.path[:] = list(base_argv), list(base_path)
        gc.collect()
        answers.write(json.dumps({"returncode": rc}) + "\n")
        answers.flush()


def _patched_classes(scheduler) -> list:
    """The classes the engine tests' scripts patch (restored after each job)."""
    out = [scheduler]
    try:
        from vllm_hisparse.vllm.spec import HiSparseManager

        out.append(HiSparseManager)
    except Exception:
        pass
    return out



# ---------------------------------------------------------------------------------------------
# The engine tests' common driver: a script (a test file run as one, its engine in-process) run
# once per tag with its JSON out path last, in the kept processes; the JSON read back per tag.
# ---------------------------------------------------------------------------------------------

def tiny_model() -> str:
    """The tiny random Llama's folder (scripts/make_tiny_model.py: built once, then reused)."""
    out = subprocess.run([sys.executable, os.path.join(_ROOT, "scripts", "make_tiny_model.py")],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


# The exactness harnesses' engines, every mode alike: prefix caching off, so a reference and the
# engine it checks run the same batches (a hit in one and not the other changes the schedule, and
# vLLM is not batch-invariant). The prefix-caching tests (test_prefix_*) turn it on in both.
SAME_SCHEDULE = {"enable_prefix_caching": False}


def engine_env(**over) -> dict:
    """This process's environment for an in-process engine of the tiny model: the engine core in
    the job's process, a 1 GiB CPU KV cache, no hub; ``over`` sets (None: unsets) more."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1")
    for k, v in over.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


class Outputs(dict):
    """{tag: CompletedProcess}; ``outputs[tag]`` is the JSON the run wrote, asserted to have run
    (a run that failed fails only the tests that read it); ``outputs.log(tag)`` its stdout +
    stderr."""

    def __init__(self, done: dict, paths: dict):
        super().__init__(done)
        self.paths = paths

    def __getitem__(self, tag):
        r = super().__getitem__(tag)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        with open(self.paths[tag]) as f:
            return json.load(f)

    def log(self, tag) -> str:
        r = super().__getitem__(tag)
        return r.stdout + r.stderr


def run_script(script: str, tmp, runs: dict, env: dict | None = None,
               timeout: float = 600) -> Outputs:
    """``python script *args OUT`` for each ``{tag: args}`` (or ``{tag: (args, env)}``), OUT =
    tmp/<tag>.json, side by side in the session's kept engine processes (``run_pooled``), in the
    order given (put the longest first); env: ``engine_env()`` unless given."""
    jobs, paths = {}, {}
    for tag, spec in runs.items():
        args, job_env = spec if isinstance(spec, tuple) else (spec, None)
        paths[tag] = os.path.join(str(tmp), f"{tag}.json")
        jobs[tag] = ([sys.executable, os.path.abspath(script), *map(str, args), paths[tag]],
                     job_env or env or engine_env())
    return Outputs(run_pooled(jobs, timeout=timeout), paths)

if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
