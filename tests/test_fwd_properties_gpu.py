"""Random valid problems through the dispatcher, against the float64 reference (hypothesis).

Each example is drawn among the problems this build can serve: a set of functional traits that
a compiled instance runnable on this GPU has (dtype, head dims, mask, bias, V layout, mode, lse,
dropout, softcap), then everything else at random: head dims below the instance's for pad_hdim
builds, sequence lengths 1..600 (tile multiples now and then, for the unpadded instances),
batch 1..3, GQA ratios, mask alignment and window sizes, the bias kind, soft-cap, dropout
probability, seed and offset, group mode with empty sequences and physical padding, seqused,
return_lse, (b, h, s, d) transposes and NaN-poisoned views. Problems fmha.select still refuses
are discarded (hypothesis.assume). The budget is fixed (300 examples, derandomized), so a run
is reproducible; the pass rule is test_fwd_gpu.py's (reference.compare).

At the end the module prints how many problems ran and the worst errors (past pytest's capture), and
writes them as JSON to $FMHA_PROPERTY_REPORT when set.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_support import TRAIT_KEYS, device_cc, import_fmha  # noqa: E402
from gpu_support import runs_here as _runs_on  # noqa: E402

hypothesis = pytest.importorskip("hypothesis", reason="pip install hypothesis")
torch, fmha = import_fmha()

from hypothesis import HealthCheck, assume, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import reference as R  # noqa: E402

DEVICE_CC = device_cc(torch)
MAX_SEQLEN = 600


def runs_here(inst) -> bool:
    return _runs_on(inst, DEVICE_CC)


# The 16-bit instances (the e4m3 forward's are test_fwd_e4m3_gpu.py's).
INSTANCES = [i for i in fmha.instances() if runs_here(i) and i["dtype"] in R.DTYPES]
GROUPS: dict = {}
for _inst in INSTANCES:
    GROUPS.setdefault(tuple(R.trait(_inst, k) for k in TRAIT_KEYS), []).append(_inst)
TRAIT_SETS = sorted(GROUPS, key=str)  # a fixed order: derandomized runs draw the same problems
if not TRAIT_SETS:
    pytest.skip(f"no compiled instance runs on compute capability "
                f"{DEVICE_CC // 10}.{DEVICE_CC % 10}",
                allow_module_level=True)


def _select_kwargs(kwargs: dict) -> dict:
    import inspect

    params = inspect.signature(fmha.select).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


@st.composite
def problems(draw):
    """(spec, input seed) of a problem with the traits of a runnable instance."""
    key = draw(st.sampled_from(TRAIT_SETS))
    insts = GROUPS[key]
    t = dict(zip(TRAIT_KEYS, key))
    padded = [i for i in insts if R.trait(i, "pad_seqlen")]
    tiles = sorted({(i["block_m"], i["block_n"]) for i in insts if not R.trait(i, "pad_seqlen")})

    d, dv = t["hdim_q"], t["hdim_v"]
    if any(R.trait(i, "pad_hdim") for i in insts) and draw(st.booleans()):
        d = 8 * draw(st.integers(1, d // 8))
        dv = 8 * draw(st.integers(1, dv // 8))
    hk = draw(st.integers(1, 4))
    ratio = draw(st.sampled_from([1, 2, 4, 8]))
    hk = min(hk, max(1, 16 // ratio))
    spec = R.Spec(R.DTYPES[t["dtype"]], d, dv, hq=hk * ratio, hk=hk,
                  layout=draw(st.sampled_from(R.LAYOUTS)))

    lengths = st.integers(0, MAX_SEQLEN)
    if t["mode"] == "group":
        b = draw(st.integers(1, 3))
        spec = spec.replace(seqlens_q=draw(st.lists(lengths, min_size=b, max_size=b)),
                            seqlens_k=draw(st.lists(lengths, min_size=b, max_size=b)))
        if draw(st.booleans()):  # physical padding after each sequence: seqused
            pads = st.lists(st.integers(0, 16), min_size=b, max_size=b)
            spec = spec.replace(pad_q=draw(pads), pad_k=draw(pads))
    else:
        b = draw(st.integers(1, 3))
        if tiles and (not padded or draw(st.booleans())):  # tile multiples: unpadded instances
            m, n = draw(st.sampled_from(tiles))
            sq = m * draw(st.integers(1, max(1, MAX_SEQLEN // m)))
            sk = n * draw(st.integers(1, max(1, MAX_SEQLEN // n)))
        else:
            sq, sk = draw(st.integers(1, MAX_SEQLEN)), draw(st.integers(1, MAX_SEQLEN))
        spec = spec.replace(b=b, sq=sq, sk=sk)
        if padded and draw(st.integers(0, 3)) == 0:
            spec = spec.replace(
                used_q=draw(st.lists(st.integers(0, sq), min_size=b, max_size=b)),
                used_k=draw(st.lists(st.integers(0, sk), min_size=b, max_size=b)))

    align = draw(st.sampled_from(R.ALIGNS))
    if t["mask"] == "causal":
        spec = spec.replace(causal=True, align=align)
    elif t["mask"] == "window":
        side = st.one_of(st.just(-1), st.integers(0, 64), st.integers(0, MAX_SEQLEN))
        causal = draw(st.booleans())  # with causal=True the right size is 0 or -1
        left, right = draw(side), draw(st.sampled_from([-1, 0]) if causal else side)
        if left < 0 and right < 0:
            left = draw(st.integers(0, MAX_SEQLEN))
        spec = spec.replace(window=(left, right), causal=causal, align=align)
    if t["bias"] == "elementwise":
        spec = spec.replace(bias=draw(st.sampled_from(R.BIAS_KINDS)))
    elif t["bias"] == "alibi":
        spec = spec.replace(alibi=draw(st.sampled_from(R.ALIBI_KINDS)), align=align)
    if t["softcap"]:
        spec = spec.replace(softcap=draw(st.floats(0.5, 50.0)),
                            qscale=draw(st.sampled_from([1.0, 3.0])))
    if t["dropout"]:
        spec = spec.replace(
            dropout_p=draw(st.one_of(st.sampled_from([0.1, 0.5, 0.9]), st.floats(0.01, 0.95))),
            seed=draw(st.integers(0, 2**64 - 1)), offset=draw(st.integers(0, 2**32 - 1)))
    if t["lse"]:
        spec = spec.replace(lse=draw(st.booleans()))
    if t["vlayout"] == "col":
        spec = spec.replace(vcol=True)
    if draw(st.booleans()):
        spec = spec.replace(scale=draw(st.floats(0.02, 1.0)))
    return spec, draw(st.integers(0, 2**31 - 1))


class Report:
    """What the module ran: the count, the worst errors and the problems behind them."""

    def __init__(self):
        self.cases = 0
        self.discarded = 0
        self.worst_rel = (0.0, "")
        self.worst_ratio = (0.0, "")
        self.worst_lse = (0.0, "")
        self.instances: dict = {}

    def record(self, cmp: R.Comparison, spec: R.Spec, chosen: str):
        self.cases += 1
        self.instances[chosen] = self.instances.get(chosen, 0) + 1
        what = f"{chosen} [{spec.describe()}]"
        if cmp.rel > self.worst_rel[0]:
            self.worst_rel = (cmp.rel, what)
        if cmp.ratio > self.worst_ratio[0]:
            self.worst_ratio = (cmp.ratio, what)
        if cmp.lse_err > self.worst_lse[0]:
            self.worst_lse = (cmp.lse_err, what)

    def as_dict(self) -> dict:
        return dict(cases=self.cases, discarded=self.discarded,
                    distinct_instances=len(self.instances),
                    worst_relative_error=self.worst_rel[0], worst_relative_case=self.worst_rel[1],
                    worst_error_over_tolerance=self.worst_ratio[0],
                    worst_ratio_case=self.worst_ratio[1], worst_lse_error=self.worst_lse[0],
                    worst_lse_case=self.worst_lse[1], device=torch.cuda.get_device_name())

    def text(self) -> str:
        d = self.as_dict()
        return (f"fmha property test: {d['cases']} problems ran ({d['discarded']} discarded) on "
                f"{d['distinct_instances']} instances, {d['device']}\n"
                f"  worst relative error {d['worst_relative_error']:.3g}: "
                f"{d['worst_relative_case']}\n"
                f"  worst error / tolerance {d['worst_error_over_tolerance']:.3g}: "
                f"{d['worst_ratio_case']}\n"
                f"  worst lse error {d['worst_lse_error']:.3g}: {d['worst_lse_case']}")


REPORT = Report()


@pytest.fixture(scope="module", autouse=True)
def report(pytestconfig):
    yield REPORT
    text = REPORT.text()
    path = os.environ.get("FMHA_PROPERTY_REPORT")
    if path:
        Path(path).write_text(json.dumps(REPORT.as_dict(), indent=2) + "\n")
    capman = pytestconfig.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        with capman.global_and_fixture_disabled():
            print("\n" + text)
    else:
        print("\n" + text)


@pytest.mark.gpu
@settings(max_examples=300, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=list(HealthCheck))
@given(problem=problems())
def test_dispatcher_matches_float64(problem):
    spec, seed = problem
    inputs = R.make_inputs(spec, "cuda", seed)
    try:
        chosen = fmha.select(inputs.q, inputs.k, inputs.v, **_select_kwargs(inputs.fwd_kwargs))
    except fmha.MissingInstanceError:
        REPORT.discarded += 1
        assume(False)
    note(f"problem: {spec.describe()} (input seed {seed}); instance {chosen['name']}")
    assert runs_here(chosen), f"the dispatcher chose {chosen['name']}, which cannot run here"
    cmp = R.check_fwd(fmha, spec, instance=None, inputs=inputs)
    REPORT.record(cmp, spec, chosen["name"])
