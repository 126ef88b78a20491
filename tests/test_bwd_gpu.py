"""Every compiled backward instance against the float64 reference's gradients, on the GPU.

The cases come from what the build compiled (fmha.bwd_instances()), as tests/test_fwd_gpu.py's
come from fmha.instances(): each instance is forced by name (instance=...), instances this GPU
cannot run are skipped at collection, and each gets the forward's problems for its traits
(reference.py, bwd_instance_specs): q and k lengths that differ both ways, tile multiples
(unpadded instances) and ragged lengths with 1-row problems (padded ones), GQA 8:1, head dims
below a pad_hdim instance's, varlen batches with empty sequences and physical padding, seqused,
broadcast biases and a bool mask that empties rows, ALiBi per head and per (batch, head),
windows of both alignments and masks that leave rows without keys and keys without rows,
soft-capping, dropout against fmha.dropout_mask's pattern, (b, h, s, d) transposes, and views
into NaN-filled buffers where a kernel must not read ("poison"); with dbias, the gradient of
each broadcast bias. The backward reads the reference's output and log-sum-exp (so it is
tested alone, whichever forward instances the build has), and runs twice on an allocator whose
free blocks hold NaN, so gradients or scratch it leaves unwritten show.

Pass rule (FlashAttention's): the error of each of dq, dk, dv (and dbias) against the float64
gradients (torch.autograd.grad of reference.attention_reference, with D = rowsum(dO * O) of the
output the backward reads) is at most twice the error of the same backward computed in the
input precision with PyTorch ops, plus a small absolute term; the gradients of query rows that
see no key, of keys that no row sees, and of rows that no sequence uses are exactly 0.

Then: the deterministic mode is bitwise reproducible; the dispatcher's choice passes too;
torch.autograd.grad through fmha.fwd (with an unseeded dropout, a broadcast dout, a bias that
requires grad) gives fmha.bwd's gradients; torch.compile(fullgraph=True) runs forward and
backward and matches eager.
"""

from __future__ import annotations

import contextlib
import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_support import device_cc, import_fmha  # noqa: E402
from gpu_support import runs_here as _runs_on  # noqa: E402

torch, fmha = import_fmha()
import reference as R  # noqa: E402

MISSING_API = [n for n in ("bwd", "bwd_instances", "select_bwd") if not hasattr(fmha, n)]
if MISSING_API:
    pytest.skip(f"fmha at {getattr(fmha, '__file__', '?')} has no backward pass (no "
                f"{', '.join(MISSING_API)}); rebuild it", allow_module_level=True)

DEVICE_CC = device_cc(torch)
# The functional traits of a backward instance (fmha::BwdTraits), as bwd_instances() spells them.
BWD_TRAIT_KEYS = ("dtype", "hdim_q", "hdim_v", "mask", "bias", "mode", "dbias", "dropout",
                  "softcap")


def runs_here(inst) -> bool:
    return _runs_on(inst, DEVICE_CC)


ALL_INSTANCES = list(fmha.bwd_instances())
INSTANCES = [i for i in ALL_INSTANCES if runs_here(i)]
SKIPPED = [i for i in ALL_INSTANCES if not runs_here(i)]


def _seed(text: str) -> int:
    return zlib.crc32(text.encode())


# ------------------------------------------------------------------------------------------
# Every instance, forced
# ------------------------------------------------------------------------------------------


def instance_cases():
    for inst in INSTANCES:
        for case_id, spec in R.bwd_instance_specs(inst):
            reason = R.fits_bwd(spec, inst)
            assert not reason, f"{inst['name']}: case {case_id} does not fit ({reason})"
            yield pytest.param(inst["name"], spec, id=f"{inst['name']}-{case_id}")
    for inst in SKIPPED:
        yield pytest.param(inst["name"], None, id=inst["name"], marks=pytest.mark.skip(
            reason=f"{inst['arch']} does not run on compute capability "
                   f"{DEVICE_CC // 10}.{DEVICE_CC % 10}"))


@pytest.mark.gpu
@pytest.mark.parametrize("name,spec", list(instance_cases()))
def test_instance_gradients_match_float64(name, spec):
    R.check_bwd(fmha, spec, instance=name, seed=_seed(name + spec.describe()))


# ------------------------------------------------------------------------------------------
# Deterministic mode
# ------------------------------------------------------------------------------------------

RUNS = 5


@pytest.mark.gpu
@pytest.mark.parametrize("inst", [pytest.param(i, id=i["name"]) for i in INSTANCES])
def test_deterministic_mode_is_bitwise_reproducible(inst):
    """Five deterministic runs give the same bits (and pass), on the third case: GQA 8:1 with
    several key tiles adding into each query row's dQ; the default mode passes there too."""
    case_id, spec = R.bwd_instance_specs(inst)[2]
    case = R.bwd_case(fmha, spec, seed=_seed(inst["name"] + "deterministic"))
    what = f"{inst['name']} {case_id} [{spec.describe()}]"
    first = R.run_bwd(fmha, case, instance=inst["name"], deterministic=True)
    R.check_grads(case, first, f"{what} deterministic")
    for run in range(1, RUNS):
        again = R.run_bwd(fmha, case, instance=inst["name"], deterministic=True)
        for name, value in first.items():
            assert torch.equal(value, again[name]), (
                f"{what}: deterministic run {run + 1} differs from run 1 in {name}")
    R.check_grads(case, R.run_bwd(fmha, case, instance=inst["name"]), f"{what} default mode")


# ------------------------------------------------------------------------------------------
# The dispatcher
# ------------------------------------------------------------------------------------------


def _groups():
    """Runnable instances by functional traits, in the dispatcher's order."""
    groups: dict = {}
    for inst in INSTANCES:
        groups.setdefault(tuple(R.trait(inst, key) for key in BWD_TRAIT_KEYS), []).append(inst)
    return groups


def group_cases(salt: str):
    """One case per functional-trait group: a padded instance's, picked by a hash of `salt`."""
    for insts in _groups().values():
        template = next((i for i in insts if R.trait(i, "pad_seqlen")), insts[0])
        specs = R.bwd_instance_specs(template)
        case_id, spec = specs[_seed(template["name"] + salt) % len(specs)]
        yield pytest.param(spec, id=f"{template['name']}-{case_id}")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", list(group_cases("dispatch")))
def test_dispatched_gradients_match_float64(spec):
    inputs = R.make_inputs(spec, "cuda", seed=1)
    kwargs, _ = R.grad_kwargs(inputs)
    chosen = fmha.select_bwd(inputs.q, inputs.k, inputs.v, **kwargs, return_dbias=spec.dbias)
    assert runs_here(chosen), f"the dispatcher chose {chosen['name']}, which cannot run here"
    reason = R.fits_bwd(spec, chosen)
    assert not reason, f"the dispatcher chose {chosen['name']}, which does not fit: {reason}"
    R.check_bwd(fmha, spec, instance=None, seed=1)


# ------------------------------------------------------------------------------------------
# Autograd through fmha.fwd, and torch.compile
# ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) inside: fmha.fwd's autograd formula then runs
    the deterministic backward, so its gradients can be compared bit for bit."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def forward_case(spec: R.Spec, seed: int) -> R.BwdCase:
    """The case of `spec` with fmha.fwd's output and log-sum-exp (what autograd's backward
    reads), skipping the test where the build has no forward instance with the log-sum-exp."""
    try:
        return R.bwd_case(fmha, spec, seed=seed, forward=fmha.fwd)
    except fmha.MissingInstanceError as exc:
        pytest.skip(f"no forward instance for this problem in the build: {str(exc)[:120]}")


def autograd_grads(case: R.BwdCase, fwd_kwargs=None) -> dict:
    """torch.autograd.grad through fmha.fwd of the case's problem at its dout, in deterministic
    mode: the gradients by name (dbias: the bias, made a leaf that requires grad)."""
    inp = case.inputs
    kwargs = dict(case.kwargs if fwd_kwargs is None else fwd_kwargs)
    leaves = [inp.q.detach().requires_grad_(), inp.k.detach().requires_grad_(),
              inp.v.detach().requires_grad_()]
    if case.spec.dbias:
        kwargs["bias"] = case.bias.detach().requires_grad_()
        leaves.append(kwargs["bias"])
    with deterministic_algorithms():
        grads = torch.autograd.grad(fmha.fwd(*leaves[:3], **kwargs), leaves, inp.dout)
    torch.cuda.synchronize()
    return dict(zip(R.GRAD_NAMES, grads))


@pytest.mark.gpu
@pytest.mark.parametrize("spec", list(group_cases("autograd")))
def test_autograd_through_fwd_is_bwd(spec):
    """autograd's gradients are fmha.bwd's, bit for bit (both deterministic), given the
    forward's out and lse; and they pass against the float64 gradients."""
    case = forward_case(spec, seed=2)
    what = f"autograd [{spec.describe()}]"
    got = autograd_grads(case)
    R.check_grads(case, got, what)
    inp = case.inputs
    direct = fmha.bwd(inp.dout, inp.q, inp.k, inp.v, case.out, case.lse, **case.kwargs,
                      deterministic=True, return_dbias=spec.dbias)
    for name, value in zip(R.GRAD_NAMES, direct):
        assert torch.equal(got[name], value), f"{what}: {name} differs from fmha.bwd's"


def _plain_instance():
    """A batch-mode backward instance without bias, dropout or soft-capping."""
    for inst in INSTANCES:
        if (R.trait(inst, "mode") == "batch" and R.trait(inst, "bias") == "none"
                and R.trait(inst, "mask") in ("none", "causal") and not R.trait(inst, "dropout")
                and not R.trait(inst, "softcap")):
            return inst
    pytest.skip("no plain (batch, no bias/dropout/softcap) backward instance runs here")


def _plain_spec(inst, **changes) -> R.Spec:
    """A problem of two 333-row sequences (tile multiples for an unpadded instance), GQA 2:1."""
    padded = R.trait(inst, "pad_seqlen")
    return R.Spec(R.DTYPES[inst["dtype"]], inst["hdim_q"], inst["hdim_v"], b=2, hq=4, hk=2,
                  sq=333 if padded else 2 * inst["block_m"],
                  sk=333 if padded else 2 * inst["block_n"],
                  causal=R.trait(inst, "mask") == "causal", align="bottom_right").replace(
                      **changes)


@pytest.mark.gpu
def test_autograd_takes_any_dout_layout():
    """out.sum()'s gradient is one value broadcast (every stride 0), and a transposed dout has
    a sequence stride the kernels take: both give fmha.bwd's gradients of that dout."""
    inst = _plain_instance()
    case = forward_case(_plain_spec(inst), seed=3)
    inp = case.inputs
    leaves = [t.detach().requires_grad_() for t in (inp.q, inp.k, inp.v)]
    ones = torch.ones_like(case.out)
    with deterministic_algorithms():
        summed = torch.autograd.grad(fmha.fwd(*leaves, **case.kwargs).sum(), leaves)
        transposed = R.in_layout(inp.dout, "bhsd")
        strided = torch.autograd.grad(fmha.fwd(*leaves, **case.kwargs), leaves, transposed)
    for dout, got, what in ((ones, summed, "out.sum()"),
                            (inp.dout, strided, "a (b, h, s, d) dout")):
        want = fmha.bwd(dout, inp.q, inp.k, inp.v, case.out, case.lse, **case.kwargs,
                        deterministic=True)
        for name, g, w in zip(R.GRAD_NAMES, got, want):
            assert torch.equal(g, w), f"{what}: {name} differs from fmha.bwd's"


@pytest.mark.gpu
def test_eager_training_calls_take_a_plan():
    """A training call (inputs that need grad, grad on) repeats its signature's checks once:
    later calls run the plan's forward and backward (fmha._bwd._PlannedAttention), with the
    op's autograd formula's gradients bit for bit."""
    inst = _plain_instance()
    case = forward_case(_plain_spec(inst), seed=6)
    inp = case.inputs
    leaves = [t.detach().requires_grad_() for t in (inp.q, inp.k, inp.v)]
    with deterministic_algorithms():
        first = torch.autograd.grad(fmha.fwd(*leaves, **case.kwargs), leaves, inp.dout)
        out = fmha.fwd(*leaves, **case.kwargs)
        assert type(out.grad_fn).__name__ == "_PlannedAttentionBackward"
        again = torch.autograd.grad(out, leaves, inp.dout)
        compiled = torch.compile(lambda q, k, v: fmha.fwd(q, k, v, **case.kwargs),
                                 fullgraph=True)
        through_op = torch.autograd.grad(compiled(*leaves), leaves, inp.dout)
    for name, a, b, c in zip(R.GRAD_NAMES, first, again, through_op):
        assert torch.equal(a, b), f"{name}: a planned call's gradient differs from the first's"
        assert torch.equal(a, c), f"{name}: the op's formula's gradient differs"
    R.check_grads(case, dict(zip(R.GRAD_NAMES, again)), "planned training call")


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gradients_come_back_in_the_leaves_layout(compiled):
    """(b, h, s, d) leaves passed as transpose(1, 2) views get (b, h, s, d)-contiguous
    gradients: the kernels write them in the views' strides, so autograd's transpose back is
    the leaf's own layout and nothing is copied."""
    inst = _plain_instance()
    case = forward_case(_plain_spec(inst), seed=7)
    inp = case.inputs
    leaves = [t.detach().transpose(1, 2).contiguous().requires_grad_()
              for t in (inp.q, inp.k, inp.v)]
    attention = lambda q, k, v: fmha.fwd(q, k, v, **case.kwargs)  # noqa: E731
    if compiled:
        attention = torch.compile(attention, fullgraph=True)
    with deterministic_algorithms():
        attention(*(t.transpose(1, 2) for t in leaves)).backward(inp.dout)
    want = fmha.bwd(inp.dout, inp.q, inp.k, inp.v, case.out, case.lse, **case.kwargs,
                    deterministic=True)
    for name, leaf, w in zip(R.GRAD_NAMES, leaves, want):
        assert leaf.grad.is_contiguous(), f"{name}: strides {leaf.grad.stride()}"
        assert torch.equal(leaf.grad.transpose(1, 2), w), f"{name} differs from fmha.bwd's"


@pytest.mark.gpu
@pytest.mark.parametrize("d,layout", [(36, "bshd"), (60, "poison"), (100, "bhsd")])
def test_head_dims_not_multiples_of_8_run_padded(d, layout):
    """Head dims that are no multiple of 8 run on zero-padded copies (fmha._head_dims) with the
    softmax scale of the call's own head dim: the forward's output and log-sum-exp, fmha.bwd's
    gradients and autograd's against float64. The poison layout's views hold NaN past their
    head dim, which the copies must leave behind."""
    inst = _plain_instance()
    spec = _plain_spec(inst).replace(d=d, dv=d, layout=layout, lse=True)
    try:
        R.check_fwd(fmha, spec, what="padded head dims")
    except fmha.MissingInstanceError as exc:
        pytest.skip(f"no instance for the padded head dim in the build: {str(exc)[:120]}")
    R.check_bwd(fmha, spec, what="padded head dims", calls=1)
    case = forward_case(spec, seed=4)
    R.check_grads(case, autograd_grads(case), f"autograd, padded head dims [{spec.describe()}]")


@pytest.mark.gpu
def test_autograd_of_an_unseeded_dropout_replays_its_pattern():
    """An unseeded forward draws its seed from torch's generator (torch.manual_seed makes it
    known); its backward must drop exactly what the forward dropped."""
    inst = next((i for i in INSTANCES if R.trait(i, "dropout") and R.trait(i, "mode") == "batch"
                 and R.trait(i, "pad_seqlen")), None)
    if inst is None:
        pytest.skip("no padded batch-mode dropout backward instance runs here")
    torch.manual_seed(7)
    seed = int(torch.randint(2**63 - 1, ()))  # the seed fmha.fwd draws after manual_seed(7)
    _, spec = R.bwd_instance_specs(inst)[2]
    spec = spec.replace(dropout_p=0.3, seed=seed, offset=0)
    case = forward_case(spec, seed=4)  # seeded with the seed the unseeded call will draw
    unseeded = {n: v for n, v in case.kwargs.items() if n not in ("dropout_seed",
                                                                  "dropout_offset")}
    torch.manual_seed(7)
    R.check_grads(case, autograd_grads(case, unseeded), f"unseeded dropout [{spec.describe()}]")


@pytest.mark.gpu
def test_compiled_forward_and_backward_match_eager():
    inst = _plain_instance()
    case = forward_case(_plain_spec(inst), seed=5)
    inp = case.inputs
    kwargs = case.kwargs
    eager = autograd_grads(case)
    leaves = [t.detach().requires_grad_() for t in (inp.q, inp.k, inp.v)]
    compiled = torch.compile(lambda q, k, v: fmha.fwd(q, k, v, **kwargs), fullgraph=True)
    with deterministic_algorithms():
        out = compiled(*leaves)
        grads = torch.autograd.grad(out, leaves, inp.dout)
    torch.cuda.synchronize()
    assert torch.equal(out, case.out)
    for name, value in zip(R.GRAD_NAMES, grads):
        assert torch.equal(value, eager[name]), f"compiled {name} differs from eager"
    R.check_grads(case, dict(zip(R.GRAD_NAMES, grads)), "compiled")


# ------------------------------------------------------------------------------------------
# What fails before a launch, and empty problems
# ------------------------------------------------------------------------------------------

MISSING_CANDIDATES = [
    ("softcap", dict(softcap=5.0)),
    ("dropout", dict(dropout_p=0.3, seed=1)),
    ("alibi", dict(alibi="head")),
    ("dbias", dict(bias="11", dbias=True)),
    ("window", dict(window=(8, 8))),
    # Past the largest head dim of the matrix: missing from every build.
    ("hdim264", dict(d=264, dv=264)),
]


@pytest.mark.gpu
def test_missing_bwd_instance_names_the_filter(monkeypatch):
    monkeypatch.setenv("FMHA_JIT", "0")  # as the forward's test: the message of a plain miss
    inst = _plain_instance()
    base = R.Spec(R.DTYPES[inst["dtype"]], inst["hdim_q"], inst["hdim_v"], b=1, hq=2, hk=2,
                  sq=64, sk=64)
    for name, changes in MISSING_CANDIDATES:
        spec = base.replace(**changes)
        if any(not R.fits_bwd(spec, i) for i in ALL_INSTANCES):  # fits_bwd says why it cannot
            continue  # compiled (maybe for another arch): not a miss
        case = R.bwd_case(fmha, spec)
        with pytest.raises(fmha.MissingInstanceError, match=r"(?i)filter") as caught:
            R.run_bwd(fmha, case)
        assert isinstance(caught.value, ValueError)
        return
    pytest.fail("a head dim of 264 is in no build, so some candidate must be missing")


@pytest.mark.gpu
def test_forced_bwd_instance_that_does_not_fit_fails_before_launch():
    unpadded = [i for i in INSTANCES if not R.trait(i, "pad_seqlen")]
    if not unpadded:
        pytest.skip("no unpadded backward instance runs here")
    inst = unpadded[0]
    spec, _ = R.apply_traits(R.Spec(R.DTYPES[inst["dtype"]], inst["hdim_q"], inst["hdim_v"],
                                    sq=inst["block_m"] + 1, sk=inst["block_n"]), inst, 0)
    case = R.bwd_case(fmha, spec.replace(dbias=bool(R.trait(inst, "dbias"))))
    with pytest.raises(ValueError):
        R.run_bwd(fmha, case, instance=inst["name"])
    if SKIPPED:  # an instance of another arch: its own problem, on the wrong GPU
        other = SKIPPED[0]
        _, spec = R.bwd_instance_specs(other)[0]
        with pytest.raises(ValueError):
            R.run_bwd(fmha, R.bwd_case(fmha, spec), instance=other["name"])


@pytest.mark.gpu
def test_empty_batch_returns_empty_gradients():
    inst = _plain_instance()
    dtype = R.DTYPES[inst["dtype"]]
    # A length the instance takes: any for a padded one, a multiple of its tiles (powers of two)
    # for an unpadded one.
    s = 16 if R.trait(inst, "pad_seqlen") else max(inst["block_m"], inst["block_n"])
    q = torch.randn(0, s, 2, inst["hdim_q"], device="cuda", dtype=dtype)
    v = torch.randn(0, s, 2, inst["hdim_v"], device="cuda", dtype=dtype)
    lse = torch.empty(0, 2, s, device="cuda", dtype=torch.float32)
    causal = R.trait(inst, "mask") == "causal"
    dq, dk, dv = fmha.bwd(v, q, q, v, v, lse, causal=causal)
    assert dq.shape == q.shape and dk.shape == q.shape and dv.shape == v.shape
