#!/usr/bin/env python3
"""Runs every compiled fmha kernel instance on a few tiny problems, for compute-sanitizer: the
forward's, the backward's and KV-cache attention's.

    python3 scripts/sanitize.py [--ops fwd,bwd,kvcache] [--filter SUBSTRING]... [--limit N]
                                [--cases N] [--list]
    compute-sanitizer --tool memcheck --leak-check full --error-exitcode 1 \\
        python3 scripts/sanitize.py --device-reset          (scripts/sanitize.sh does this)

A few problems per instance of the build (one instance per distinct set of traits and tile, per
pipeline; an instance compiled for several architectures runs once, on the one this GPU
prefers, unless --all-archs), each forced with instance=NAME, synchronized, and checked against
the float64 reference of tests/reference.py, computed on the CPU so that the sanitizer
instruments as few kernels besides fmha's as possible. The problems are small and cover the
edges, with inputs that are views into NaN-filled buffers ("poison": a read past the data shows
up as NaN in the output even where the sanitizer sees an in-bounds address).

- fwd (fmha.instances(), two problems each; traits: dtype, head dims, mask, bias, V layout,
  mode, lse, dropout, soft-cap, sequence and head-dim padding): lengths that are not tile
  multiples, GQA, varlen batches with empty sequences, sequences without keys and physical
  padding, seqused, masks and bool attn_masks that leave rows empty, head dims below a padded
  instance's.
- bwd (fmha.bwd_instances(), fa2 and fa3 as compiled): the forward's two problems for the same
  traits (dbias where the instance writes it), the reference's output and log-sum-exp as the
  forward's (the poison layout's NaN around them and in rows no sequence uses), dout poisoned
  alike; each problem runs twice, the default and the deterministic mode, each on an allocator
  whose free blocks of the gradients' and the workspace's sizes hold NaN, and each call's dq,
  dk, dv (and dbias) pass against the float64 gradients, exactly 0 where no key or row is seen.
- kvcache (fmha.kvcache_instances()): decode with several key splits (the combine), paged
  caches on pages of every size class the launcher tells apart and contiguous ones with
  cache_batch_idx and cache_leftpad, k/v appended with rotary (interleaved and not), head dims
  below a padded instance's, a full-grid step, and chunked prefill on the prefill (fa3)
  instances; the caches the call leaves are checked too (scripts/sanitize_kvcache.py says
  what each case is for).

One line per case, then a summary line; exit status 0 when every case passed, 1 when one
failed, 2 for bad arguments or no usable GPU/fmha, 3 when --time-budget stopped it early.
Instances run in coverage order, per operation: each adds the most trait values (then pairs of
values) of its operation not yet covered, and the operations take turns instance by instance,
so --limit N (racecheck's subset) and a run cut short by --time-budget still touch every
operation and, within it, every dtype, head dim, mask, bias, layout, mode, pipeline and
padding. An instance's problems come most telling first, so --cases 1 keeps the first.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import sanitize_kvcache as kvcache

REPO = Path(__file__).resolve().parent.parent

DEVICE = "cuda"

# The traits that tell instances apart, besides the architecture and the tile.
KEY_TRAITS = ("dtype", "hdim_q", "hdim_v", "mask", "bias", "vlayout", "mode", "lse", "dropout",
              "softcap", "pad_seqlen", "pad_hdim")
# A backward instance's (fmha::BwdTraits, no V layout or lse; dbias), and its pipeline: fa2 and
# fa3 synchronize differently, so a subset takes both.
BWD_KEY_TRAITS = ("dtype", "hdim_q", "hdim_v", "mask", "bias", "mode", "dbias", "dropout",
                  "softcap", "pad_seqlen", "pad_hdim", "pipeline")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="sanitize.py",
        description="Run every compiled fmha instance (forward, backward, KV cache) on a few "
                    "tiny problems (for compute-sanitizer), each synchronized and checked "
                    "against the float64 reference; one line per case and a summary.")
    ap.add_argument("--ops", default=",".join(OPERATIONS), metavar="OP[,OP...]",
                    help=f"the operations whose instances run, of {', '.join(OPERATIONS)} "
                         "(default: all)")
    ap.add_argument("--filter", action="append", default=[], metavar="SUBSTRING",
                    help="keep instances whose name contains SUBSTRING; repeat to require "
                         "several, '|' inside one for alternatives (e.g. causal|window)")
    ap.add_argument("--limit", type=int, default=0, metavar="N",
                    help="keep N instances of each operation, those covering the most trait "
                         "values first (0: all)")
    ap.add_argument("--shard", default="1/1", metavar="K/N",
                    help="run part K of N of each operation's chosen instances (every N-th in "
                         "coverage order, from the K-th), so that N processes on N GPUs share "
                         "a large build (scripts/sanitize.sh's FMHA_SANITIZE_GPUS)")
    ap.add_argument("--cases", type=int, default=0, metavar="N",
                    help="problems per instance, its first N (0, the default: all of them: 2 "
                         "for the forward and the backward, 4 to 8 for the KV cache)")
    ap.add_argument("--all-archs", action="store_true",
                    help="run every runnable instance, also the same traits compiled for "
                         "another architecture")
    ap.add_argument("--no-check", action="store_true",
                    help="launch and synchronize only, no comparison with the reference")
    ap.add_argument("--time-budget", type=float, default=0, metavar="SECONDS",
                    help="start no case after SECONDS (0: no budget); exit 3 if cut short")
    ap.add_argument("--device-reset", action="store_true",
                    help="at the end free all cached memory and reset the device's primary "
                         "context, so that --leak-check reports only real leaks")
    ap.add_argument("--seed", type=int, default=0,
                    help="mixed into each case's input seed (a hash of its name; default 0)")
    ap.add_argument("--list", action="store_true",
                    help="print the cases without running them")
    ap.add_argument("-q", "--quiet", action="store_true", help="print only failures and the "
                    "summary")
    args = ap.parse_args(argv)
    if args.limit < 0:
        ap.error("--limit must be >= 0")
    if args.cases < 0:
        ap.error("--cases must be >= 0")
    shard = re.fullmatch(r"([1-9][0-9]*)/([1-9][0-9]*)", args.shard)
    if not shard or int(shard[1]) > int(shard[2]):
        ap.error(f"--shard takes K/N with 1 <= K <= N, e.g. 2/4; got {args.shard!r}")
    args.shard = (int(shard[1]), int(shard[2]))
    ops = list(dict.fromkeys(op.strip() for op in args.ops.split(",") if op.strip()))
    unknown = [op for op in ops if op not in OPERATIONS]
    if unknown or not ops:
        ap.error(f"--ops takes a comma-separated list of {', '.join(OPERATIONS)}; got "
                 f"{args.ops!r}")
    args.ops = ops
    return args


# ---------------------------------------------------------------------------------------------
# Which instances, which problems (plain Python: no CUDA needed)
# ---------------------------------------------------------------------------------------------


def trait(inst: dict, key: str):
    defaults = dict(mask="none", bias="none", vlayout="row", mode="batch", lse=False,
                    dropout=False, softcap=False, pad_seqlen=True, pad_hdim=False, dbias=False,
                    full_grid_block_n=0)
    return inst.get(key, defaults.get(key))


def key_of(inst: dict, keys=KEY_TRAITS) -> tuple:
    return tuple(trait(inst, k) for k in keys)


def matches(name: str, filters: list) -> bool:
    return all(any(alt in name for alt in f.split("|")) for f in filters)


def choose_instances(instances: list, runs_here, filters: list, limit: int,
                     all_archs: bool, keys=KEY_TRAITS) -> tuple[list, int]:
    """(the instances to run, how many of the filtered ones cannot run here)."""
    chosen = [i for i in instances if matches(i["name"], filters)]
    runnable = [i for i in chosen if runs_here(i)]
    not_here = len(chosen) - len(runnable)
    if not all_archs:  # the first of each key: the listings give the preferred arch first
        seen, unique = set(), []
        for inst in runnable:
            k = key_of(inst, keys) + (inst.get("pipeline"), inst.get("block_m"),
                                      inst.get("block_n"))
            if k not in seen:
                seen.add(k)
                unique.append(inst)
        runnable = unique
    # Coverage order always: a run cut short by --time-budget has still touched every trait.
    runnable = by_coverage(runnable, keys)
    return (runnable[:limit] if limit else runnable), not_here


def by_coverage(instances: list, keys=KEY_TRAITS) -> list:
    """The instances reordered so that each adds the most trait values not yet seen, then the
    most pairs of trait values (padded and group mode, bias and window...), then the earliest."""
    values, pairs = [], []  # each instance's, computed once: the loop below is quadratic
    for inst in instances:
        v = [(k, trait(inst, k)) for k in keys]
        values.append(set(v))
        pairs.append({(a, b) for n, a in enumerate(v) for b in v[n + 1:]})

    rest, order, seen_values, seen_pairs = list(range(len(instances))), [], set(), set()
    while rest:
        best = max(rest, key=lambda i: (len(values[i] - seen_values),
                                        len(pairs[i] - seen_pairs), -i))
        order.append(instances[best])
        seen_values |= values[best]
        seen_pairs |= pairs[best]
        rest.remove(best)
    return order


def shapes(inst: dict) -> list:
    """Two small problems for the instance: (label, Spec fields, index for apply_traits)."""
    m, n = inst["block_m"], inst["block_n"]
    dq, dv = inst["hdim_q"], inst["hdim_v"]
    hd = []  # head dims below a padded instance's: just under, and about half
    if trait(inst, "pad_hdim"):
        hd = [dict(d=max(8, dq - 8), dv=max(8, dv - 8)),
              dict(d=max(8, dq // 2 // 8 * 8), dv=max(8, dv // 2 // 8 * 8 - 8))]
    else:
        hd = [{}, {}]
    if trait(inst, "mode") == "group":
        return [
            # Empty sequence, a sequence without keys, a 1-row one; physical padding after
            # each (seqused), ragged tiles, GQA 2:1, NaN poison around the data.
            ("varlen_empty_gqa", dict(seqlens_q=[m + 3, 0, 1, 37], seqlens_k=[2 * n + 1, 5, 0, 37],
                                      pad_q=[2, 0, 1, 3], pad_k=[0, 3, 1, 8], hq=4, hk=2,
                                      layout="poison", **hd[0]), 0),
            # Bottom-right alignment with s_q > s_k: rows that see no key; (h, s, d) storage.
            ("varlen_q_gt_k", dict(seqlens_q=[70, 5], seqlens_k=[9, 130], hq=2, hk=1,
                                   layout="bhsd", **hd[1]), 1),
        ]
    if trait(inst, "pad_seqlen"):
        return [
            ("ragged_gqa", dict(b=2, sq=m + 17, sk=2 * n + 5, hq=4, hk=2, layout="poison",
                                **hd[0]), 0),
            # seqused: a sequence of one row, one without keys; s_q > s_k bottom-right empties
            # rows; GQA 4:1.
            ("seqused_empty", dict(b=3, sq=m // 2 + 9, sk=23, used_q=[m // 2 + 9, 1, 7],
                                   used_k=[23, 0, 9], hq=4, hk=1, layout="poison", **hd[1]), 1),
        ]
    return [
        ("tiles_gqa", dict(b=2, sq=2 * m, sk=2 * n, hq=4, hk=2, layout="poison", **hd[0]), 0),
        # s_q > s_k bottom-right: the first query tiles see no key.
        ("q_gt_k", dict(b=1, sq=2 * m, sk=n, hq=4, hk=1, layout="bhsd", **hd[1]), 1),
    ]


def make_spec(R, inst: dict, fields: dict, idx: int, backward: bool = False):
    """The Spec of a problem of shapes() with the instance's traits; backward: a backward
    instance's, asking for the bias gradient where the instance writes it."""
    fields = dict(fields)
    spec = R.Spec(R.DTYPES[inst["dtype"]], fields.pop("d", inst["hdim_q"]),
                  fields.pop("dv", inst["hdim_v"]), **fields)
    spec, label = R.apply_traits(spec, inst, idx)
    if backward and trait(inst, "dbias"):
        spec, label = spec.replace(dbias=True), f"{label}-dbias" if label else "dbias"
    reason = (R.fits_bwd if backward else R.fits)(spec, inst)
    if reason:
        raise AssertionError(f"sanitize.py made a case {inst['name']} cannot run ({reason}): "
                             f"{spec.describe()}")
    return spec, label


def spec_cases(R, inst: dict, backward: bool = False) -> list:
    """A forward instance's problems, or (backward) a backward instance's: shapes() with its
    traits (R.apply_traits finds no V layout or lse trait in a backward instance, so none asks
    for V^T), dbias where it writes it. (label, Spec)."""
    cases = []
    for label, fields, idx in shapes(inst):
        spec, traits = make_spec(R, inst, fields, idx, backward)
        cases.append((f"{label}-{traits}" if traits else label, spec))
    return cases


# ---------------------------------------------------------------------------------------------
# Running (imports torch, fmha and tests/reference.py)
# ---------------------------------------------------------------------------------------------


def _cpu(x):
    import torch
    return x.cpu() if isinstance(x, torch.Tensor) else x


def run_case(torch, fmha, R, inst: dict, spec, seed: int, check: bool) -> str:
    """Runs one case; returns a short result, raises on a failure."""
    inputs = R.make_inputs(spec, DEVICE, seed)
    keep = None
    if spec.dropout_p:
        b, h, sq, sk = inputs.keep_shape
        keep_gpu = fmha.dropout_mask(spec.seed, spec.offset, spec.dropout_p, b, h, sq, sk)
    result = fmha.fwd(inputs.q, inputs.k, inputs.v, **inputs.fwd_kwargs, instance=inst["name"])
    torch.cuda.synchronize()
    out, lse = R.split_result(result, spec)
    if not check:
        return "ran"
    if spec.dropout_p:
        keep = keep_gpu.cpu()
        want = R.dropout_keep_mask(spec.seed, spec.offset, spec.dropout_p, b, h, sq, sk)
        assert torch.equal(keep, want), "fmha.dropout_mask differs from the reference Philox"
    q, k, v = inputs.q.cpu(), inputs.k.cpu(), inputs.v.cpu()
    ref_kwargs = {name: _cpu(x) for name, x in inputs.ref_kwargs.items()}
    ref, ref_lse = R.attention_reference(q, k, v, **ref_kwargs, dropout_keep=keep)
    lowp, _ = R.attention_reference(q, k, v, **ref_kwargs, dropout_keep=keep,
                                    compute_dtype=spec.dtype)
    cmp = R.compare(out.cpu(), ref, lowp, dtype=spec.dtype,
                    lse=lse.cpu() if lse is not None else None,
                    ref_lse=ref_lse if spec.lse else None, what=spec.describe())
    return f"err {cmp.err:.2e} <= {cmp.tol:.2e}"


def run_bwd_case(torch, fmha, R, inst: dict, spec, seed: int, check: bool) -> str:
    """Runs one backward case in the default and then the deterministic mode (R.run_bwd: each
    call on a poisoned allocator, the second finding what the first left in any scratch);
    returns a short result, raises on a failure."""
    inputs = R.make_inputs(spec, DEVICE, seed, grad=True)
    kwargs, ref_kwargs = R.grad_kwargs(inputs)
    ref_kwargs = {name: _cpu(x) for name, x in ref_kwargs.items()}
    q, k, v, dout = (t.cpu() for t in (inputs.q, inputs.k, inputs.v, inputs.dout))
    keep = (R.dropout_keep_mask(spec.seed, spec.offset, spec.dropout_p, *inputs.keep_shape)
            if spec.dropout_p else None)
    # What the forward returned, as the backward's caller holds it: the output rounded to the
    # input dtype in the spec's layout (NaN in rows no sequence uses, and around them in the
    # poison layout), the log-sum-exp (NaN in those rows, -inf where no key is seen).
    exact, lse = R.attention_reference(q, k, v, **ref_kwargs, dropout_keep=keep)
    out = R.in_layout(exact.to(spec.dtype).to(DEVICE), spec.layout)
    truth = lowp = None
    if check:
        truth = R.attention_grads(q, k, v, dout, **ref_kwargs, dropout_keep=keep,
                                  dbias=spec.dbias, bwd_out=out.cpu())
        lowp = R.attention_grads(q, k, v, dout, **ref_kwargs, dropout_keep=keep,
                                 dbias=spec.dbias, compute_dtype=spec.dtype)
    case = R.BwdCase(spec, inputs, out, lse.float().contiguous().to(DEVICE), kwargs, truth,
                     lowp)
    worst = None
    for deterministic in (False, True):
        got = R.run_bwd(fmha, case, instance=inst["name"], deterministic=deterministic)
        if not check:
            continue
        got = {name: g.cpu() for name, g in got.items()}
        what = f"deterministic={deterministic}"  # the failure's line names the rest
        for name, cmp in R.check_grads(case, got, what).items():
            if worst is None or cmp.ratio > worst[1].ratio:
                worst = (name, cmp)
    if worst is None:
        return "ran twice"
    name, cmp = worst
    return f"default and deterministic, worst {name} err {cmp.err:.2e} <= {cmp.tol:.2e}"


@dataclass(frozen=True)
class Operation:
    """An operation whose compiled instances run: `listing` names fmha's function that lists
    them, `key_traits` tells them apart (coverage order, one per architecture), `cases` gives an
    instance's problems as (label, case with .describe()), and `run` runs one (torch, fmha,
    reference, instance, case, seed, check) and returns a short result."""

    listing: str
    key_traits: tuple
    cases: Callable
    run: Callable


OPERATIONS = {
    "fwd": Operation("instances", KEY_TRAITS, spec_cases, run_case),
    "bwd": Operation("bwd_instances", BWD_KEY_TRAITS,
                     lambda R, inst: spec_cases(R, inst, backward=True), run_bwd_case),
    "kvcache": Operation("kvcache_instances", kvcache.KEY_TRAITS,
                         lambda R, inst: kvcache.instance_cases(inst), kvcache.run_case),
}


def make_plan(R, chosen: dict, cases: int) -> list:
    """(op, instance, label, case) of every case, the operations taking turns instance by
    instance, each instance's cases together."""
    plan = []
    for rank in range(max((len(insts) for insts in chosen.values()), default=0)):
        for op, insts in chosen.items():
            if rank < len(insts):
                inst = insts[rank]
                todo = OPERATIONS[op].cases(R, inst)
                plan += [(op, inst, label, case) for label, case in todo[:cases or len(todo)]]
    return plan


def context_alive(torch) -> bool:
    try:
        torch.cuda.synchronize()
        torch.ones(1, device=DEVICE).add_(1).item()
        return True
    except Exception:  # a sticky error: every later CUDA call fails
        return False


def reset_device(torch) -> str:
    """Frees what torch caches and resets the primary context (cuDevicePrimaryCtxReset), so
    that memcheck's leak check at context teardown sees only memory someone really leaked."""
    import ctypes
    import gc

    try:
        gc.collect()
        torch.cuda.synchronize()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
    except Exception as exc:  # a sticky CUDA error: reset anyway
        print(f"sanitize.py: freeing before the reset failed: {exc}", flush=True)
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev = ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()) != 0:
            return "device reset skipped (cuDeviceGet failed)"
        rc = cuda.cuDevicePrimaryCtxReset(dev)
        return "device reset" if rc == 0 else f"device reset failed (CUresult {rc})"
    except OSError as exc:
        return f"device reset skipped ({exc})"


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO / "tests"))
    try:
        import torch
    except ImportError as exc:
        print(f"sanitize.py: needs torch ({exc})", file=sys.stderr)
        return 2
    try:
        import fmha
    except Exception as exc:
        print(f"sanitize.py: cannot import fmha ({exc!r}); put a build's python/ directory on "
              "PYTHONPATH (scripts/sanitize.sh does)", file=sys.stderr)
        return 2
    import reference as R
    from gpu_support import device_cc, runs_here

    have_gpu = torch.cuda.is_available()
    if not have_gpu and not args.list:
        print("sanitize.py: needs a CUDA GPU (torch.cuda.is_available() is False); --list "
              "works without one", file=sys.stderr)
        return 2
    cc = device_cc(torch) if have_gpu else None
    compiled, chosen, not_here, n_unsharded = {}, {}, 0, 0
    for op in args.ops:
        operation = OPERATIONS[op]
        listing = getattr(fmha, operation.listing, None)
        compiled[op] = list(listing()) if listing is not None else []  # an fmha that predates it
        chosen[op], skipped = choose_instances(
            compiled[op], (lambda i: runs_here(i, cc)) if cc else (lambda i: True), args.filter,
            args.limit, args.all_archs, operation.key_traits)
        n_unsharded += len(chosen[op])
        part, parts = args.shard
        chosen[op] = chosen[op][part - 1::parts]
        not_here += skipped
    n_compiled = sum(len(insts) for insts in compiled.values())
    n_chosen = sum(len(insts) for insts in chosen.values())
    if not n_chosen and n_unsharded:
        print(f"sanitize.py: shard {args.shard[0]}/{args.shard[1]} holds none of the "
              f"{n_unsharded} instances to run")
        return 0
    if not n_chosen:
        print(f"sanitize.py: no instance to run (operations {','.join(args.ops)}, filters "
              f"{args.filter}, {not_here} filtered instances do not run on this GPU)",
              file=sys.stderr)
        return 2

    plan = make_plan(R, chosen, args.cases)
    per_op = ", ".join(
        f"{op} {sum(1 for entry in plan if entry[0] == op)} cases on {len(chosen[op])} of "
        f"{len(compiled[op])} instances" if compiled[op] else f"{op} none compiled"
        for op in args.ops)
    if args.shard != (1, 1):
        per_op += "; shard %d/%d" % args.shard
    if args.list:
        for n, (op, inst, label, case) in enumerate(plan, 1):
            print(f"[{n:4d}/{len(plan)}] {inst['name']} {label}: {case.describe()}")
        print(f"sanitize.py plan: {len(plan)} cases on {n_chosen} instances (of {n_compiled} "
              f"compiled; {per_op})")
        return 0

    print(f"sanitize.py: {len(plan)} cases on {n_chosen} instances (of {n_compiled} compiled, "
          f"{not_here} filtered out as not runnable on sm{cc}; {per_op}); torch "
          f"{torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    start = time.time()
    failed, passed, cut = [], 0, 0
    for n, (op, inst, label, case) in enumerate(plan, 1):
        if args.time_budget and time.time() - start > args.time_budget:
            cut = len(plan) - n + 1
            print(f"sanitize.py: time budget of {args.time_budget:g} s spent; {cut} cases "
                  "not run", flush=True)
            break
        t0 = time.time()
        try:
            seed = zlib.crc32(f"{inst['name']} {label}".encode()) ^ args.seed  # per case
            note = OPERATIONS[op].run(torch, fmha, R, inst, case, seed, not args.no_check)
            passed += 1
            if not args.quiet:
                print(f"[{n:4d}/{len(plan)}] ok   {inst['name']} {label} ({note}, "
                      f"{time.time() - t0:.2f} s)", flush=True)
        except Exception as exc:
            msg = " ".join(str(exc).split())[:400] or repr(exc)
            failed.append(f"{inst['name']} {label}")
            print(f"[{n:4d}/{len(plan)}] FAIL {inst['name']} {label} "
                  f"[{case.describe()}]: {type(exc).__name__}: {msg}", flush=True)
            if not context_alive(torch):
                cut = len(plan) - n
                print(f"sanitize.py: the CUDA context is unusable after that failure; {cut} "
                      "cases not run", flush=True)
                break
    elapsed = time.time() - start
    reset_note = ""
    if args.device_reset:
        reset_note = "; " + reset_device(torch)
    status = 1 if failed else (3 if cut else 0)
    print(f"sanitize.py summary: {passed} passed, {len(failed)} failed, {cut} not run, of "
          f"{len(plan)} cases on {n_chosen} instances in {elapsed:.1f} s{reset_note}"
          + (f"; failed: {', '.join(failed[:10])}" + (" ..." if len(failed) > 10 else "")
             if failed else ""), flush=True)
    return status


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if "--device-reset" in sys.argv[1:]:
        import os

        os._exit(code)  # nothing of torch's teardown after the context is gone
    sys.exit(code)
