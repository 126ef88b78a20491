"""fmha.fwd's planned calls on the GPU (fmha._plans): a signature's second call reuses the
first call's checks and FwdArgs, with its own tensors, seed and offset, and still computes the
float64 reference's answer; a value its plan did not check still fails as the checks say.

The specs need a batch-mode instance of bf16 or fp16 at head dim 64 or 128 for this GPU (any
preset builds one); a build without it skips the test that needs it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_support import import_fmha  # noqa: E402

torch, fmha = import_fmha()
import reference as R  # noqa: E402
from fmha import _api  # noqa: E402

SPECS = {
    "plain": R.Spec(torch.bfloat16, 128, 128, hq=4, hk=4, b=2, sq=256, sk=256),
    "causal_gqa_lse": R.Spec(torch.bfloat16, 64, 64, hq=8, hk=2, b=2, sq=200, sk=333,
                             causal=True, align="bottom_right", lse=True),
    "bhsd_window": R.Spec(torch.float16, 128, 128, hq=2, hk=2, b=1, sq=130, sk=130,
                          window=(40, 0), layout="bhsd"),
    "seqused": R.Spec(torch.bfloat16, 128, 128, hq=2, hk=2, b=2, sq=128, sk=256,
                      used_q=[100, 128], used_k=[7, 256], lse=True),
    "group": R.Spec(torch.bfloat16, 64, 64, hq=4, hk=4, seqlens_q=[17, 0, 90],
                    seqlens_k=[40, 5, 90], pad_q=[0, 3, 8], pad_k=[8, 0, 0], lse=True),
}


def _skip_unless_built(spec: R.Spec):
    inputs = R.make_inputs(spec)
    try:
        fmha.select(inputs.q, inputs.k, inputs.v, **inputs.fwd_kwargs)
    except fmha.MissingInstanceError as exc:
        pytest.skip(f"no instance for {spec.describe()} in this build: {str(exc)[:80]}")


@pytest.mark.parametrize("name", SPECS)
def test_a_signature_plans_once_and_runs_new_tensors(name):
    spec = SPECS[name]
    _skip_unless_built(spec)
    _api._PLANS.clear()
    for seed in (1, 2, 3):  # fresh tensors of the same signature each time
        R.check_fwd(fmha, spec, seed=seed, what=f"call {seed}")
        assert len(_api._PLANS) == 1, "a call of a known signature made a plan of its own"


def test_one_plan_serves_dropout_seeds_and_offsets():
    spec = R.Spec(torch.bfloat16, 128, 128, hq=2, hk=2, b=1, sq=128, sk=192, dropout_p=0.3)
    _skip_unless_built(spec)
    _api._PLANS.clear()
    for seed, offset in ((5, 0), (2**64 - 3, 7), (123, 2**32 - 1)):
        R.check_fwd(fmha, spec.replace(seed=seed, offset=offset))
    assert len(_api._PLANS) == 1


def test_an_unseeded_planned_call_draws_its_seed_from_torch():
    """torch.manual_seed makes an unseeded call reproducible, first call of a signature or
    not: each draws one seed, as fmha.fwd's docstring says."""
    spec = SPECS["plain"].replace(dropout_p=0.25)
    _skip_unless_built(spec)
    inputs = R.make_inputs(spec)
    q, k, v = inputs.q, inputs.k, inputs.v
    _api._PLANS.clear()
    for _ in range(2):
        torch.manual_seed(11)
        drawn = fmha.fwd(q, k, v, dropout_p=0.25)
        torch.manual_seed(11)
        seed = int(torch.randint(2**63 - 1, ()))
        assert torch.equal(drawn, fmha.fwd(q, k, v, dropout_p=0.25, dropout_seed=seed))
    assert len(_api._PLANS) == 2  # seeded and unseeded calls have signatures of their own


def test_a_planned_signature_still_rejects_what_its_checks_reject():
    spec = SPECS["plain"].replace(causal=True, lse=True)
    _skip_unless_built(spec)
    inputs = R.make_inputs(spec)
    q, k, v = inputs.q, inputs.k, inputs.v
    good = dict(causal=True, softmax_scale=0.5, return_lse=True, dropout_seed=1)
    fmha.fwd(q, k, v, **good)
    for change, error, message in (
            (dict(causal=1), TypeError, "causal must be a bool"),
            (dict(softmax_scale=True), TypeError, "softmax_scale must be a float"),
            (dict(return_lse=1), TypeError, "return_lse must be a bool"),
            (dict(window_size=(8, False)), TypeError, "window_size must be a"),
            (dict(dropout_seed=-1), ValueError, "dropout_seed must be in"),
            (dict(dropout_offset=2**32), ValueError, "dropout_offset must be in"),
            # A list where a tensor belongs: the signature is not made of it (no AttributeError).
            (dict(seqused_q=[256, 256]), TypeError, "seqused_q must be a torch.Tensor"),
            (dict(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be a torch.Tensor")):
        with pytest.raises(error, match=message):
            fmha.fwd(q, k, v, **{**good, **change})
    out, lse = fmha.fwd(q, k, v, **good)
    with pytest.raises(TypeError, match="fmha.bwd: seqused_k must be a torch.Tensor"):
        fmha.bwd(out, q, k, v, out, lse, causal=True, softmax_scale=0.5, dropout_seed=1,
                 seqused_k=(256, 256))
    # Same shape and strides, 2 bytes off a 16-byte boundary: only the pointer differs.
    off = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape)
    with pytest.raises(ValueError, match="q starts 2 bytes past a 16-byte boundary"):
        fmha.fwd(off, k, v, **good)


def test_modes_subclasses_and_grad_take_the_op():
    """What the plans must not bypass: a dispatch mode sees fmha::fwd, and calls with tensor
    subclasses or with a bias that autograd records go through the op as before."""
    from torch.utils._python_dispatch import TorchDispatchMode

    spec = SPECS["plain"]
    _skip_unless_built(spec)
    inputs = R.make_inputs(spec)
    q, k, v = inputs.q, inputs.k, inputs.v
    fmha.fwd(q, k, v)  # a plan exists for the signature

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Recorder() as recorder:
        fmha.fwd(q, k, v)
    assert "fmha.fwd.default" in recorder.ops

    def key(q, bias=None):
        return _api._plans.call_key(q, k, v, False, None, (-1, -1), "top_left", bias, None,
                                    None, 0.0, 0.0, None, 0, False, None, None, None, None,
                                    None, None, None)
    # A call autograd records has a key of its own (its plan trains), but not with a bias,
    # whose gradient the op's formula computes.
    inference = key(q)
    training = key(q.requires_grad_())
    assert training is not None and training != inference
    assert key(q, bias=torch.zeros(256, 256, dtype=q.dtype, device=q.device)) is None
    q.requires_grad_(False)
    assert _api._plans.call_key(torch.nn.Parameter(q, requires_grad=False), k, v, False, None,
                                (-1, -1), "top_left", None, None, None, 0.0, 0.0, None, 0,
                                False, None, None, None, None, None, None, None) is None


def test_the_ops_calls_plan_too():
    """A torch.compile'd call runs the op fmha::fwd, which keeps plans of its own: fresh tensors
    of one signature take one plan and give the eager call's results bitwise."""
    spec = SPECS["causal_gqa_lse"]
    _skip_unless_built(spec)

    def attention(q, k, v):
        return fmha.fwd(q, k, v, causal=True, mask_align="bottom_right", return_lse=True)

    compiled = torch.compile(attention, fullgraph=True)
    _api._OP_PLANS.clear()
    for seed in (1, 2):
        inputs = R.make_inputs(spec, seed=seed)
        eager = attention(inputs.q, inputs.k, inputs.v)
        traced = compiled(inputs.q, inputs.k, inputs.v)
        assert all(torch.equal(a, b) for a, b in zip(eager, traced))
    assert len(_api._OP_PLANS) == 1


class _PassThrough(__import__("torch.utils._python_dispatch", fromlist=["x"]).TorchDispatchMode):
    """A dispatch mode that changes nothing: under it fmha.fwd runs its op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("through_op", [False, True], ids=["eager", "op"])
def test_varlen_batches_of_other_lengths_share_a_plan(through_op):
    """Packed batches differ in token counts and longest lengths from one step to the next;
    a plan leaves both to the call, eager or through the op. (A batch of at most one token,
    whose token stride is no stride, has a signature of its own.)"""
    spec = SPECS["group"]
    _skip_unless_built(spec)
    batches = [spec, spec.replace(seqlens_q=[33, 7, 12], seqlens_k=[60, 1, 100]),
               spec.replace(seqlens_q=[2, 0, 0], seqlens_k=[0, 3, 9], pad_q=[0, 0, 0]),
               spec.replace(seqlens_q=[5, 200, 64], seqlens_k=[5, 250, 64])]
    table = _api._OP_PLANS if through_op else _api._PLANS
    table.clear()
    for seed, batch in enumerate(batches):
        with _PassThrough() if through_op else _no_mode():
            R.check_fwd(fmha, batch, seed=seed, what=f"batch {seed}")
        assert len(table) == 1, f"batch {seed} made a plan of its own"


def test_a_varlen_plan_made_without_tokens_serves_one_token():
    """0 and 1 tokens share a signature (no token stride either way). The plan made for the
    call without tokens, whose q is a strided view that torch counts as contiguous for want of
    elements, must still give the next call outputs laid out as its FwdArgs say."""
    spec = R.Spec(torch.bfloat16, 64, 64, hq=4, hk=1, seqlens_q=[0], seqlens_k=[1],
                  layout="poison")
    _skip_unless_built(spec)
    _api._PLANS.clear()
    for seqlens_q, seqlens_k in (([0], [1]), ([1], [0]), ([1], [1])):
        R.check_fwd(fmha, spec.replace(seqlens_q=seqlens_q, seqlens_k=seqlens_k))
    assert len(_api._PLANS) == 1


def _no_mode():
    import contextlib

    return contextlib.nullcontext()
