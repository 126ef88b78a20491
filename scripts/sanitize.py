#!/usr/bin/env python3
"""Runs every compiled fmha kernel instance on a few tiny problems, for compute-sanitizer.

    python3 scripts/sanitize.py [--filter SUBSTRING]... [--limit N] [--cases 1|2] [--list]
    compute-sanitizer --tool memcheck --leak-check full --error-exitcode 1 \\
        python3 scripts/sanitize.py --device-reset          (scripts/sanitize.sh does this)

One or two problems per instance of the build (one per distinct set of traits: dtype, head
dims, mask, bias, V layout, mode, lse, dropout, soft-cap, sequence and head-dim padding; an
instance compiled for several architectures runs once, on the one this GPU prefers, unless
--all-archs), each forced with instance=NAME, synchronized, and checked against the float64
reference of tests/reference.py, computed on the CPU so that the sanitizer instruments as few
kernels besides fmha's as possible. The problems are small and cover the edges: lengths that
are not tile multiples, GQA, varlen batches with empty sequences, sequences without keys and
physical padding, seqused, masks and bool attn_masks that leave rows empty, head dims below a
padded instance's, and inputs that are views into NaN-filled buffers ("poison": a read past
the data shows up as NaN in the output even where the sanitizer sees an in-bounds address).

One line per case, then a summary line; exit status 0 when every case passed, 1 when one
failed, 2 for bad arguments or no usable GPU/fmha, 3 when --time-budget stopped it early.
Instances run in coverage order: each adds the most trait values (then pairs of values) not yet
covered, so --limit N (racecheck's subset) and a run cut short by --time-budget still touch
every dtype, head dim, mask, bias, layout, mode and padding.
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

DEVICE = "cuda"

# The traits that tell instances apart, besides the architecture and the tile.
KEY_TRAITS = ("dtype", "hdim_q", "hdim_v", "mask", "bias", "vlayout", "mode", "lse", "dropout",
              "softcap", "pad_seqlen", "pad_hdim")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="sanitize.py",
        description="Run every compiled fmha instance on a few tiny problems (for "
                    "compute-sanitizer), each synchronized and checked against the float64 "
                    "reference; one line per case and a summary.")
    ap.add_argument("--filter", action="append", default=[], metavar="SUBSTRING",
                    help="keep instances whose name contains SUBSTRING; repeat to require "
                         "several, '|' inside one for alternatives (e.g. causal|window)")
    ap.add_argument("--limit", type=int, default=0, metavar="N",
                    help="keep N instances, those covering the most trait values first "
                         "(0: all)")
    ap.add_argument("--cases", type=int, default=2, choices=(1, 2),
                    help="problems per instance (default 2)")
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
    return args


# ---------------------------------------------------------------------------------------------
# Which instances, which problems (plain Python: no CUDA needed)
# ---------------------------------------------------------------------------------------------


def trait(inst: dict, key: str):
    defaults = dict(mask="none", bias="none", vlayout="row", mode="batch", lse=False,
                    dropout=False, softcap=False, pad_seqlen=True, pad_hdim=False)
    return inst.get(key, defaults.get(key))


def key_of(inst: dict) -> tuple:
    return tuple(trait(inst, k) for k in KEY_TRAITS)


def matches(name: str, filters: list) -> bool:
    return all(any(alt in name for alt in f.split("|")) for f in filters)


def choose_instances(instances: list, runs_here, filters: list, limit: int,
                     all_archs: bool) -> tuple[list, int]:
    """(the instances to run, how many of the filtered ones cannot run here)."""
    chosen = [i for i in instances if matches(i["name"], filters)]
    runnable = [i for i in chosen if runs_here(i)]
    not_here = len(chosen) - len(runnable)
    if not all_archs:  # the first of each key: fmha.instances() lists the preferred arch first
        seen, unique = set(), []
        for inst in runnable:
            k = key_of(inst) + (inst.get("block_m"), inst.get("block_n"))
            if k not in seen:
                seen.add(k)
                unique.append(inst)
        runnable = unique
    # Coverage order always: a run cut short by --time-budget has still touched every trait.
    runnable = by_coverage(runnable)
    return (runnable[:limit] if limit else runnable), not_here


def by_coverage(instances: list) -> list:
    """The instances reordered so that each adds the most trait values not yet seen, then the
    most pairs of trait values (padded and group mode, bias and window...), then the earliest."""

    def values(inst):
        return [(k, trait(inst, k)) for k in KEY_TRAITS]

    def pairs(inst):
        v = values(inst)
        return {(a, b) for n, a in enumerate(v) for b in v[n + 1:]}

    rest, order, seen_values, seen_pairs = list(instances), [], set(), set()
    while rest:
        best = max(rest, key=lambda i: (len(set(values(i)) - seen_values),
                                        len(pairs(i) - seen_pairs), -rest.index(i)))
        order.append(best)
        seen_values |= set(values(best))
        seen_pairs |= pairs(best)
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


# ---------------------------------------------------------------------------------------------
# Running (imports torch, fmha and tests/reference.py)
# ---------------------------------------------------------------------------------------------


def make_spec(R, inst: dict, fields: dict, idx: int):
    fields = dict(fields)
    spec = R.Spec(R.DTYPES[inst["dtype"]], fields.pop("d", inst["hdim_q"]),
                  fields.pop("dv", inst["hdim_v"]), **fields)
    spec, label = R.apply_traits(spec, inst, idx)
    reason = R.fits(spec, inst)
    if reason:
        raise AssertionError(f"sanitize.py made a case {inst['name']} cannot run ({reason}): "
                             f"{spec.describe()}")
    return spec, label


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
    instances = list(fmha.instances())
    chosen, not_here = choose_instances(
        instances, (lambda i: runs_here(i, cc)) if cc else (lambda i: True), args.filter,
        args.limit, args.all_archs)
    if not chosen:
        print(f"sanitize.py: no instance to run (filters {args.filter}, {not_here} filtered "
              "instances do not run on this GPU)", file=sys.stderr)
        return 2

    plan = []
    for inst in chosen:
        for label, fields, idx in shapes(inst)[:args.cases]:
            spec, traits = make_spec(R, inst, fields, idx)
            plan.append((inst, f"{label}-{traits}" if traits else label, spec))
    if args.list:
        for n, (inst, label, spec) in enumerate(plan, 1):
            print(f"[{n:4d}/{len(plan)}] {inst['name']} {label}: {spec.describe()}")
        print(f"sanitize.py plan: {len(plan)} cases on {len(chosen)} instances "
              f"(of {len(instances)} compiled)")
        return 0

    print(f"sanitize.py: {len(plan)} cases on {len(chosen)} instances (of {len(instances)} "
          f"compiled, {not_here} filtered out as not runnable on sm{cc}); torch "
          f"{torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    start = time.time()
    failed, passed, cut = [], 0, 0
    for n, (inst, label, spec) in enumerate(plan, 1):
        if args.time_budget and time.time() - start > args.time_budget:
            cut = len(plan) - n + 1
            print(f"sanitize.py: time budget of {args.time_budget:g} s spent; {cut} cases "
                  "not run", flush=True)
            break
        t0 = time.time()
        try:
            seed = zlib.crc32(f"{inst['name']} {label}".encode()) ^ args.seed  # per case
            note = run_case(torch, fmha, R, inst, spec, seed, not args.no_check)
            passed += 1
            if not args.quiet:
                print(f"[{n:4d}/{len(plan)}] ok   {inst['name']} {label} ({note}, "
                      f"{time.time() - t0:.2f} s)", flush=True)
        except Exception as exc:
            msg = " ".join(str(exc).split())[:400] or repr(exc)
            failed.append(f"{inst['name']} {label}")
            print(f"[{n:4d}/{len(plan)}] FAIL {inst['name']} {label} "
                  f"[{spec.describe()}]: {type(exc).__name__}: {msg}", flush=True)
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
          f"{len(plan)} cases on {len(chosen)} instances in {elapsed:.1f} s{reset_note}"
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
