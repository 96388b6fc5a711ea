"""The verdict of a GPU exactness run (scripts/gpu_exactness.py, scripts/gpu_dsa.py): EXACT only when
the run could have failed and did not.

Six things are checked, each printed:

0. the reference is reproducible: a second reference engine (``again``) gives the same tokens and
   logprobs. Two engines of one config that differ (seen on the GPU, 2026-12-06; cause not yet
   known: compiled graphs or batches, see check 3) make any difference unattributable: VOID. Required where the caller passes ``again`` (the GPU scripts); ``None``: not applicable;
1. every engine's greedy tokens and logprobs equal the reference engine's (resident mode), request
   by request; any difference is a MISMATCH;
2. attention matters: the reference engine also ran each prompt with its context shuffled (the
   last token kept, ``shuffled``); most prompts' greedy tokens must change. Where they do not,
   the logits depend on the current token only (vLLM's ``dummy`` weights) and identical outputs
   prove nothing: VOID;
3. (where the engines recorded them) the batches: vLLM is not batch-invariant, so an engine whose
   outputs differ while its schedule (tokens per request per step) differs from the reference's
   proves nothing either way: its difference is unattributable (VOID), not a MISMATCH;
4. the negative control (hisparse with HISPARSE_TEST_CORRUPT_FETCH=1: every page fetched from the
   host pool is its neighbour's) must differ from the reference, clearly: some greedy token, or
   the logprobs of at least CONTROL_STEPS steps (a wrong fetch moves many; one step's 1e-6 is
   what other numerics give, and a test's control once "mismatched" by that alone, 2026-12-07).
   Its schedule, where recorded, must be the reference's (other batches: its difference is not
   the fetch's). A control that matches, or fetched nothing (0 misses): VOID;
5. (speculative runs: ``spec``, vLLM's acceptance counters per engine) every engine's drafts,
   draft tokens and accepted tokens equal the reference's (a difference counts as an output
   difference: MISMATCH under the same batches), and the reference accepted some draft (one that
   speculated nothing proves nothing for speculation: VOID). Drafts follow each engine's own
   outputs, so under speculation schedules are compared only before the first decode step
   (``before_decode``): up to there a step's batch cannot depend on any output.

A request is a dict with "tokens" (ids) and "logprobs" (any JSON; compared whole).

    python scripts/exact_verdict.py REF.json ENGINE.json... [--control C.json] [--shuffled S.json]
        [--again REF2.json]

(each file: {"requests": [...]} or gpu_exactness's {"batches": [[...], ...]}: its first batch;
``--shuffled`` takes the reference's second batch when given the reference file itself).
"""
from __future__ import annotations

import argparse
import json
import random
import sys

EXACT, MISMATCH, VOID = 0, 1, 3
CONTROL_STEPS = 5      # check 4: a control with every token equal must move this many steps
WORDS = {EXACT: "EXACT", MISMATCH: "MISMATCH", VOID: "VOID"}


def shuffle_context(prompt: list[int], seed: int = 0) -> list[int]:
    """``prompt`` with every token but the last in a random order: what a model whose attention
    mattered would answer differently."""
    head = list(prompt[:-1])
    random.Random(seed).shuffle(head)
    return head + list(prompt[-1:])


def first_difference(a: list, b: list) -> int | None:
    """The first index where a and b differ (the shorter one's length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def same(ref: list[dict], got: list[dict]) -> tuple[bool, list[str]]:
    """Tokens and logprobs of every request identical? And a line per request."""
    if len(ref) != len(got) or not ref:
        return False, [f"{len(got)} requests vs the reference's {len(ref)}: nothing to compare"]
    ok, lines = True, []
    for i, (r, g) in enumerate(zip(ref, got)):
        st, sl = r["tokens"] == g["tokens"], r["logprobs"] == g["logprobs"]
        ok &= st and sl
        n = r.get("prompt_len", "?")
        lines.append(f"request {i} ({n} tokens): tokens identical {st} (first difference at "
                     f"{first_difference(r['tokens'], g['tokens'])}), logprobs identical {sl}")
    return ok, lines


def differing_steps(ref: list[dict], got: list[dict]) -> tuple[int, int]:
    """(requests whose greedy tokens differ, steps whose logprobs differ) over matching requests
    (logprobs a list per step; otherwise the whole value counts as one step)."""
    toks = steps = 0
    for r, g in zip(ref, got):
        toks += r["tokens"] != g["tokens"]
        a, b = r["logprobs"], g["logprobs"]
        if isinstance(a, list) and isinstance(b, list):
            steps += sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
        else:
            steps += a != b
    return toks, steps


def control_caught(ref: list[dict], control: list[dict], misses: int | None,
                   schedule_diff) -> tuple[bool, str]:
    """Check 4: did the negative control mismatch clearly, for the fetch's sake?"""
    toks, steps = differing_steps(ref, control)
    caught = toks > 0 or steps >= CONTROL_STEPS
    what = f"{toks} requests' tokens and {steps} steps' logprobs differ"
    if toks == 0 and steps == 0 and len(ref) == len(control):
        why = "negative control: MATCHED"
    elif caught:
        why = f"negative control: mismatched, as it must ({what})"
    else:
        why = f"negative control: barely differs ({what}; < {CONTROL_STEPS} steps, no token)"
    if misses is not None:
        why += f" ({misses} misses)"
    if misses == 0:
        caught, why = False, why + ": it fetched nothing"
    if caught and schedule_diff not in (None, "unknown"):
        caught, why = False, why + (f": but its schedule differs from the reference's at step "
                                    f"{schedule_diff}, so the difference is not the fetch's")
    return caught, why


def attention_matters(ref: list[dict], shuffled: list[dict]) -> tuple[bool, str]:
    """Most prompts' greedy tokens change when their context is shuffled?"""
    if not shuffled or len(shuffled) != len(ref):
        return False, (f"attention matters: not shown ({len(shuffled or [])} shuffled-context "
                       f"requests for {len(ref)} prompts)")
    changed = sum(r["tokens"] != s["tokens"] for r, s in zip(ref, shuffled))
    ok = 2 * changed > len(ref)
    return ok, (f"attention matters: {'yes' if ok else 'NO'}, a shuffled context changes the "
                f"greedy tokens of {changed} of {len(ref)} prompts")


def reproducible(ref: list[dict], again: list[dict] | None) -> tuple[bool, list[str]]:
    """The reference engine run twice gives the same outputs? ``again`` None: not applicable (an
    engine known deterministic); [] (the second run missing): not shown."""
    if again is None:
        return True, []
    if not again:
        return False, ["reference reproducible: NOT SHOWN (no second reference run)"]
    ok, ls = same(ref, again)
    return ok, [f"reference twice {x}" for x in ls] + [
        f"reference reproducible: {'yes' if ok else 'NO'}, a second reference engine gives "
        f"{'the same' if ok else 'different'} tokens and logprobs"]


def schedule_difference(ref: list | None, got: list | None) -> int | None | str:
    """The first step where two engines' schedules differ (None: identical; "unknown": one was not
    recorded)."""
    if ref is None or got is None:
        return "unknown"
    return first_difference(ref, got)


def before_decode(schedule: list | None, prompt_lens: list) -> list | None:
    """A recorded schedule ([[request, tokens], ...] per step) up to the first step that schedules
    some request past its prompt (its first decode step); the whole schedule if a prompt length
    is unknown (None)."""
    if schedule is None or any(not isinstance(n, int) for n in prompt_lens):
        return schedule
    done: dict[int, int] = {}
    for i, step in enumerate(schedule):
        for r, t in step:
            done[r] = done.get(r, 0) + t
            if r < len(prompt_lens) and done[r] > prompt_lens[r]:
                return schedule[:i]
    return schedule


def _counts(c: dict) -> str:
    d, t, a = (c.get(f"vllm:spec_decode_num_{k}", 0) for k in ("drafts", "draft_tokens",
                                                                "accepted_tokens"))
    return f"{d} drafts, {a} of {t} draft tokens accepted"


def acceptance(spec: dict, names) -> tuple[list[str], list[str], bool, list[str]]:
    """Check 5: (engines whose counters differ from the reference's, engines that recorded none,
    did the reference accept a draft, the lines)."""
    ref = spec.get("reference")
    if ref is None:
        return [], ["reference"], False, ["reference acceptance: NOT RECORDED"]
    lines = [f"reference acceptance: {_counts(ref)}"]
    differ, missing = [], []
    for name in names:
        got = spec.get(name)
        if got is None:
            missing.append(name)
            lines.append(f"{name} acceptance: NOT RECORDED")
        elif got != ref:
            differ.append(name)
            lines.append(f"{name} acceptance: {_counts(got)}: DIFFERS from the reference's")
        else:
            lines.append(f"{name} acceptance: identical to the reference's")
    return differ, missing, ref.get("vllm:spec_decode_num_accepted_tokens", 0) > 0, lines


def verdict(ref: list[dict], engines: dict[str, list[dict]], control: list[dict] | None,
            shuffled: list[dict] | None, control_misses: int | None = None,
            again: list[dict] | None = None,
            schedules: dict[str, list] | None = None,
            spec: dict[str, dict | None] | None = None) -> tuple[int, list[str]]:
    """(EXACT / MISMATCH / VOID, the lines to print). control_misses: the control's miss count
    when known (0: it fetched nothing, so it could not mismatch). again: a second reference run
    (see reproducible); a reference that is not reproducible voids every comparison. schedules:
    each engine's recorded batches by name, the reference's as "reference", the negative
    control's as "control" (see checks 3 and 4). spec: a speculative run's acceptance counters
    by name (SPEC_COUNTERS of scripts/hisparse_generate.py), the reference's as "reference"
    (check 5); None: not a speculative run."""
    stable, lines = reproducible(ref, again)
    exact, unattributable = True, []
    schedules = schedules or {}
    differ, missing, speculated = [], [], True
    if spec is not None:
        differ, missing, speculated, ls = acceptance(spec, engines)
        lines += ls
        lens = [r.get("prompt_len") for r in ref]
        schedules = {k: before_decode(v, lens) for k, v in schedules.items()}
    for name, got in engines.items():
        ok, ls = same(ref, got)
        ok &= name not in differ
        lines += [f"{name} {x}" for x in ls]
        d = schedule_difference(schedules.get("reference"), schedules.get(name))
        if d != "unknown":
            lines.append(f"{name} schedule: " + ("identical to the reference's" if d is None else
                         f"differs from the reference's at step {d}"))
        if not ok and d not in (None, "unknown"):
            unattributable.append(name)       # other batches: vLLM's own numerics differ
        else:
            exact &= ok
    matters, line = attention_matters(ref, shuffled)
    lines.append(line)
    if control is None:
        caught, why = False, "negative control: not run"
    else:
        caught, why = control_caught(ref, control, control_misses, schedule_difference(
            schedules.get("reference"), schedules.get("control")))
    lines.append(why)
    if not engines:
        code = VOID
        lines.append("no engine to compare")
    elif not stable:
        code = VOID
    elif not exact:
        code = MISMATCH
    elif unattributable or missing:
        code = VOID
    elif not (matters and caught and speculated):
        code = VOID
    else:
        code = EXACT
    if code == VOID and not stable:
        lines.append("VOID (the reference is not reproducible: differences from it prove nothing)")
    elif code == VOID and unattributable:
        lines.append(f"VOID ({', '.join(unattributable)}: outputs differ but so do the batches "
                     f"vLLM ran: not attributable)")
    elif code == VOID and missing:
        lines.append(f"VOID ({', '.join(missing)}: acceptance counters not recorded)")
    else:
        lines.append(f"{WORDS[code]}" + ("" if code != VOID else
                     " (identical outputs here prove nothing: " +
                     ", ".join(w for w, bad in (("attention did not matter", not matters),
                                                ("the negative control did not mismatch clearly",
                                                 not caught),
                                                ("no draft was accepted in the reference: a "
                                                 "speculative run that speculated nothing",
                                                 not speculated)) if bad) + ")"))
    return code, lines


def requests_of(path: str, batch: int = 0) -> list[dict]:
    d = json.load(open(path))
    if "requests" in d:
        return d["requests"] if batch == 0 else d.get("shuffled", [])
    b = d.get("batches", [])
    return b[batch] if len(b) > batch else []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reference")
    p.add_argument("engines", nargs="*")
    p.add_argument("--control")
    p.add_argument("--shuffled", help="the shuffled-context outputs (default: the reference's)")
    p.add_argument("--again", help="a second run of the reference engine (must equal it)")
    a = p.parse_args(argv)
    ref = requests_of(a.reference)
    engines = {e: requests_of(e) for e in a.engines}
    control = requests_of(a.control) if a.control else None
    shuf = requests_of(a.shuffled or a.reference, 1)
    again = requests_of(a.again) if a.again else None
    code, lines = verdict(ref, engines, control, shuf, again=again)
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    sys.exit(main())
