"""Every compiled instance against the float64 reference (tests/reference.py), on the GPU.

The cases come from what the build compiled (fmha.instances()), so a build with another preset
or filter tests exactly its own instances. Each instance is forced by name (instance=...), so
the sm80 instances run on a Hopper GPU too; instances this GPU cannot run are skipped at
collection. Every instance gets a few problems that exercise its traits (reference.py,
instance_specs): q and k lengths that differ both ways, tile multiples (unpadded instances) and
ragged lengths with 1-row problems (padded ones), GQA 8:1, head dims below a pad_hdim
instance's, varlen batches with empty sequences and physical padding (group mode), seqused,
broadcast biases and a bool attn_mask that empties rows, ALiBi per head and per (batch, head),
windows of both alignments and masks that leave rows empty, soft-capping, dropout against
fmha.dropout_mask's pattern, V^T, the log-sum-exp, (b, h, s, d) transposes, and views into
NaN-filled buffers where a kernel must not read ("poison"). A few cases go through the
dispatcher.

Pass rule (FlashAttention-3's and FlexAttention's): the error against the float64 reference is
at most twice the error of the same attention computed in the input precision with PyTorch ops,
plus a small absolute term; rows that see no key are exactly 0 with lse -inf.
"""

from __future__ import annotations

import inspect
import math
import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_support import TRAIT_KEYS, device_cc, import_fmha  # noqa: E402
from gpu_support import runs_here as _runs_on  # noqa: E402

torch, fmha = import_fmha()
import reference as R  # noqa: E402
from generator.schema import PIPELINE  # noqa: E402

DEVICE_CC = device_cc(torch)


def runs_here(inst) -> bool:
    return _runs_on(inst, DEVICE_CC)


def traits_of(inst) -> tuple:
    return tuple(R.trait(inst, key) for key in TRAIT_KEYS)


# The 16-bit instances: the e4m3 (FP8) forward's have their own tests (test_fwd_e4m3_gpu.py).
ALL_INSTANCES = [i for i in fmha.instances() if i["dtype"] in R.DTYPES]
INSTANCES = [i for i in ALL_INSTANCES if runs_here(i)]
SKIPPED = [i for i in ALL_INSTANCES if not runs_here(i)]


def _seed(text: str) -> int:
    return zlib.crc32(text.encode())


def _select_kwargs(kwargs: dict) -> dict:
    """fwd's keyword arguments that fmha.select takes too."""
    params = inspect.signature(fmha.select).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


def split(result, spec):
    return R.split_result(result, spec)


def run_and_check(spec, instance=None, seed=0):
    """Runs `spec` through fmha.fwd (forced to `instance` when given) against the reference."""
    return R.check_fwd(fmha, spec, instance=instance, seed=seed)


# ------------------------------------------------------------------------------------------
# Every instance, forced
# ------------------------------------------------------------------------------------------


def instance_cases():
    for inst in INSTANCES:
        for case_id, spec in R.instance_specs(inst):
            reason = R.fits(spec, inst)
            assert not reason, f"{inst['name']}: case {case_id} does not fit ({reason})"
            yield pytest.param(inst["name"], spec, id=f"{inst['name']}-{case_id}")
    for inst in SKIPPED:
        yield pytest.param(inst["name"], None, id=inst["name"], marks=pytest.mark.skip(
            reason=f"{inst['arch']} does not run on compute capability "
                   f"{DEVICE_CC // 10}.{DEVICE_CC % 10}"))


@pytest.mark.gpu
@pytest.mark.parametrize("name,spec", list(instance_cases()))
def test_instance_matches_float64(name, spec):
    run_and_check(spec, instance=name, seed=_seed(name + spec.describe()))


# ------------------------------------------------------------------------------------------
# Dropout: a function of (seed, offset) only
# ------------------------------------------------------------------------------------------

DROPOUT_INSTANCES = [i for i in INSTANCES if R.trait(i, "dropout")]


@pytest.mark.gpu
@pytest.mark.parametrize("inst", [pytest.param(i, id=i["name"]) for i in DROPOUT_INSTANCES])
def test_dropout_is_reproducible(inst):
    # The third case: GQA 8:1, no seqused rows left untouched (they would hold garbage).
    _, spec = R.instance_specs(inst)[2]
    assert not (spec.used_q or spec.pad_q)
    spec = spec.replace(dropout_p=0.5, seed=2**40 + 17, offset=11)
    inputs = R.make_inputs(spec, "cuda", seed=5)

    def run(**changes):
        kwargs = dict(inputs.fwd_kwargs, **changes)
        out, _ = split(fmha.fwd(inputs.q, inputs.k, inputs.v, **kwargs, instance=inst["name"]),
                       spec)
        torch.cuda.synchronize()
        assert not out.isnan().any()
        return out

    first = run()
    assert torch.equal(first, run()), "same seed and offset: bitwise the same output"
    assert not torch.equal(first, run(dropout_seed=2**40 + 18)), "another seed, another output"
    assert not torch.equal(first, run(dropout_offset=12)), "another offset, another output"


@pytest.mark.gpu
@pytest.mark.parametrize("seed,offset,p,shape", [
    (0, 0, 0.5, (1, 1, 1, 1)),
    (1, 0, 0.1, (2, 3, 17, 33)),
    (2**40 + 3, 7, 0.5, (3, 2, 129, 130)),
    (2**64 - 1, 2**32 - 1, 0.9, (1, 4, 64, 1000)),
])
def test_dropout_mask_is_reference_philox(seed, offset, p, shape):
    keep = fmha.dropout_mask(seed, offset, p, *shape)
    torch.cuda.synchronize()
    assert torch.equal(keep, R.dropout_keep_mask(seed, offset, p, *shape, device=keep.device))
    frac = keep.double().mean().item()
    n = keep.numel()
    assert n < 100 or abs(frac - (1 - p)) < 6 * math.sqrt(p * (1 - p) / n) + 1e-9


# ------------------------------------------------------------------------------------------
# The dispatcher
# ------------------------------------------------------------------------------------------


def _groups():
    """Runnable instances by functional traits, in the dispatcher's order."""
    groups: dict = {}
    for inst in INSTANCES:
        groups.setdefault(traits_of(inst), []).append(inst)
    return groups


def dispatch_cases():
    for key, insts in _groups().items():
        template = next((i for i in insts if R.trait(i, "pad_seqlen")), insts[0])
        specs = R.instance_specs(template)
        case_id, spec = specs[_seed(template["name"]) % len(specs)]
        yield pytest.param(spec, id=f"{template['name']}-{case_id}")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", list(dispatch_cases()))
def test_dispatched_matches_float64(spec):
    inputs = R.make_inputs(spec, "cuda", seed=1)
    chosen = fmha.select(inputs.q, inputs.k, inputs.v, **_select_kwargs(inputs.fwd_kwargs))
    assert runs_here(chosen), f"the dispatcher chose {chosen['name']}, which cannot run here"
    assert not R.fits(spec, chosen), f"{chosen['name']} does not fit: {R.fits(spec, chosen)}"
    run_and_check(spec, instance=None, seed=1)


def _preference_cases():
    for key, insts in _groups().items():
        if any(R.trait(i, "mode") == "batch" and not R.trait(i, "pad_seqlen") for i in insts):
            yield pytest.param(insts[0], id="-".join(str(k) for k in key))


@pytest.mark.gpu
@pytest.mark.parametrize("template", list(_preference_cases()))
def test_dispatcher_prefers_unpadded_and_this_arch(template):
    """A problem of tile multiples goes to the native arch when it is compiled, there to the
    newest pipeline, and to that pipeline's unpadded instance when it has one (fa3 has none:
    TMA zero-fills ragged tiles); a ragged one to a padded instance."""
    key = traits_of(template)
    same = [i for i in INSTANCES if traits_of(i) == key]
    spec, _ = R.apply_traits(R.Spec(R.DTYPES[template["dtype"]], template["hdim_q"],
                                    template["hdim_v"], hq=2, hk=2, sq=1024, sk=1024), template, 0)
    inputs = R.make_inputs(spec, "cuda")
    chosen = fmha.select(inputs.q, inputs.k, inputs.v, **_select_kwargs(inputs.fwd_kwargs))
    if any(i["arch"] == "sm90a" for i in same):
        assert chosen["arch"] == "sm90a", "on an H100/H200 the sm90a build wins"
    newest = min((i for i in same if i["arch"] == chosen["arch"]),
                 key=lambda i: PIPELINE.tokens.index(i["pipeline"]))
    assert chosen["pipeline"] == newest["pipeline"], "the newest pipeline wins on its arch"
    if any((i["arch"], i["pipeline"]) == (chosen["arch"], chosen["pipeline"])
           and not i["pad_seqlen"] for i in same):
        assert not chosen["pad_seqlen"], "1024 fits every tile: an unpadded instance wins"
    ragged = R.make_inputs(spec.replace(sq=1000, sk=1000), "cuda")
    kwargs = _select_kwargs(ragged.fwd_kwargs)
    if any(R.trait(i, "pad_seqlen") for i in same):
        assert fmha.select(ragged.q, ragged.k, ragged.v, **kwargs)["pad_seqlen"]
    else:
        with pytest.raises(fmha.MissingInstanceError):
            fmha.select(ragged.q, ragged.k, ragged.v, **kwargs)


# ------------------------------------------------------------------------------------------
# The Python API around the kernels
# ------------------------------------------------------------------------------------------


def _plain_instance():
    for inst in INSTANCES:
        if (R.trait(inst, "mode") == "batch" and R.trait(inst, "bias") == "none"
                and R.trait(inst, "mask") in ("none", "causal") and not R.trait(inst, "dropout")
                and not R.trait(inst, "softcap") and R.trait(inst, "vlayout") == "row"):
            return inst
    pytest.skip("no plain (batch, no bias/dropout/softcap, row V) instance runs here")


@pytest.mark.gpu
def test_public_fwd_compiles_fullgraph():
    inst = _plain_instance()
    causal = R.trait(inst, "mask") == "causal"
    lse = bool(R.trait(inst, "lse"))
    spec = R.Spec(R.DTYPES[inst["dtype"]], inst["hdim_q"], inst["hdim_v"], b=2, hq=4, hk=4,
                  sq=333 if R.trait(inst, "pad_seqlen") else 2 * inst["block_m"],
                  sk=333 if R.trait(inst, "pad_seqlen") else 2 * inst["block_n"],
                  causal=causal, align="bottom_right", lse=lse)
    inputs = R.make_inputs(spec, "cuda")
    q, k, v = inputs.q, inputs.k, inputs.v
    kw = inputs.fwd_kwargs
    eager = fmha.fwd(q, k, v, **kw)
    run_and_check(spec)

    def f(a, b, c):
        r = fmha.fwd(a, b, c, **kw)
        return (r[0] * 2, r[1] + 1) if lse else r * 2

    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    if lse:
        torch.testing.assert_close(compiled[0], eager[0] * 2)
        torch.testing.assert_close(compiled[1], eager[1] + 1)
    else:
        torch.testing.assert_close(compiled, eager * 2)


MISSING_CANDIDATES = [
    ("softcap", dict(softcap=5.0)),
    ("dropout", dict(dropout_p=0.3, seed=1)),
    ("alibi", dict(alibi="head")),
    ("bias", dict(bias="11")),
    ("vcol", dict(vcol=True)),
    ("window", dict(window=(8, 8))),
    # Past the largest head dim of the matrix: missing from every build.
    ("hdim264", dict(d=264, dv=264)),
]


@pytest.mark.gpu
def test_missing_instance_names_the_filter(monkeypatch):
    # What a miss says where compile on demand is off (or has no compiler); with it on, the
    # candidates below would compile and run.
    monkeypatch.setenv("FMHA_JIT", "0")
    inst = _plain_instance()
    base = R.Spec(R.DTYPES[inst["dtype"]], inst["hdim_q"], inst["hdim_v"], b=1, hq=2, hk=2,
                  sq=64, sk=64)
    for name, changes in MISSING_CANDIDATES:
        spec = base.replace(**changes)
        if any(not R.fits(spec, i) for i in ALL_INSTANCES):  # fits() returns why it cannot
            continue  # compiled (maybe for another arch): not a miss
        inputs = R.make_inputs(spec, "cuda")
        with pytest.raises(fmha.MissingInstanceError, match=r"(?i)filter") as caught:
            fmha.fwd(inputs.q, inputs.k, inputs.v, **inputs.fwd_kwargs)
        assert isinstance(caught.value, ValueError)
        with pytest.raises(fmha.MissingInstanceError):
            fmha.select(inputs.q, inputs.k, inputs.v, **_select_kwargs(inputs.fwd_kwargs))
        return
    pytest.fail("a head dim of 264 is in no build, so some candidate must be missing")


@pytest.mark.gpu
def test_forced_instance_that_does_not_fit_fails_before_launch():
    unpadded = [i for i in INSTANCES if not R.trait(i, "pad_seqlen")]
    if not unpadded:
        pytest.skip("no unpadded instance runs here")
    inst = unpadded[0]
    spec, _ = R.apply_traits(R.Spec(R.DTYPES[inst["dtype"]], inst["hdim_q"], inst["hdim_v"],
                                    sq=inst["block_m"] + 1, sk=inst["block_n"]), inst, 0)
    inputs = R.make_inputs(spec, "cuda")
    with pytest.raises(ValueError):
        fmha.fwd(inputs.q, inputs.k, inputs.v, **inputs.fwd_kwargs, instance=inst["name"])
    if SKIPPED:  # an instance of another arch: its own problem, on the wrong GPU
        other = SKIPPED[0]
        _, spec = R.instance_specs(other)[0]
        inputs = R.make_inputs(spec, "cuda")
        with pytest.raises(ValueError):
            fmha.fwd(inputs.q, inputs.k, inputs.v, **inputs.fwd_kwargs, instance=other["name"])


@pytest.mark.gpu
def test_empty_batch_returns_empty_without_launch():
    inst = _plain_instance()
    dtype = R.DTYPES[inst["dtype"]]
    q = torch.randn(0, 16, 2, inst["hdim_q"], device="cuda", dtype=dtype)
    v = torch.randn(0, 16, 2, inst["hdim_v"], device="cuda", dtype=dtype)
    causal = R.trait(inst, "mask") == "causal"
    out = fmha.fwd(q, q, v, causal=causal)
    assert out.shape == (0, 16, 2, inst["hdim_v"])
    if R.trait(inst, "lse"):
        out, lse = fmha.fwd(q, q, v, causal=causal, return_lse=True)
        assert out.shape == (0, 16, 2, inst["hdim_v"]) and lse.shape == (0, 2, 16)
