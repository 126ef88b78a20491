"""fmha as it is installed (pip install ., or a build tree on PYTHONPATH), without a GPU.

The binaries keep their C++ and CUDA runtimes to themselves (tests/exported_symbols.py says why:
a build whose toolchain linked libstdc++ statically exported it, and every miss message crashed
the process). And a miss is an exception with a whole message, from each operation's
dispatcher: `capability=` asks for a GPU the machine does not have, with meta tensors, so the
message the dispatcher formats (the traits, the GPU, the nearest instances, the filter that
builds one) is produced here, in the same process as torch, as it is on a GPU.
"""

import importlib.util
from pathlib import Path

import pytest

from exported_symbols import nm_available, runtime_exports

torch = pytest.importorskip("torch")
fmha = pytest.importorskip("fmha", reason="the fmha module is not built")

H100 = (9, 0)
# Head dims the default and the CI builds leave out (FMHA_PRESET=extended adds them).
UNSERVED_HDIM = 256


def package_dir() -> Path:
    return Path(importlib.util.find_spec("fmha").submodule_search_locations[0])


@pytest.mark.skipif(not nm_available(), reason="needs nm (binutils)")
def test_binaries_export_no_runtime():
    libraries = sorted(package_dir().glob("libfmha*.so*")) + sorted(package_dir().glob("_C*.so"))
    assert len(libraries) >= 2, f"no libfmha and _C under {package_dir()}"
    for library in libraries:
        exported = runtime_exports(library)
        assert not exported, (f"{library.name} exports {len(exported)} symbols of the C++ or "
                              f"CUDA runtime it carries, e.g. {exported[:3]}")


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def needs_a_miss(listed: list[dict]):
    """Skips where the build has an instance of UNSERVED_HDIM among `listed`."""
    if any(i["hdim_q"] >= UNSERVED_HDIM for i in listed):
        pytest.skip(f"this build compiles head dim {UNSERVED_HDIM}: no miss to see")


def assert_whole_miss(message: str, hdim: int):
    """A miss message as the dispatcher formats it: every number in place."""
    assert f"hdim_q={hdim} hdim_v={hdim}" in message, message
    assert "on this GPU (sm90)" in message and "Nearest compiled:" in message, message
    assert f"hdim{hdim}" in message and "FMHA_FILTER='" in message and "sm90a" in message, message


def test_forward_miss_is_an_exception_with_the_whole_message():
    needs_a_miss(fmha.instances())
    q = meta(2, 500, 4, UNSERVED_HDIM)
    with pytest.raises(fmha.MissingInstanceError) as miss:
        fmha.select(q, q, q, causal=True, capability=H100)
    assert_whole_miss(str(miss.value), UNSERVED_HDIM)
    explanation = fmha.explain(q, q, q, causal=True, capability=H100)
    assert "seqlen_q=500 seqlen_k=500; this GPU is sm90." in explanation, explanation
    assert_whole_miss(explanation, UNSERVED_HDIM)


def test_backward_miss_is_an_exception_with_the_whole_message():
    needs_a_miss(fmha.bwd_instances())
    q = meta(2, 500, 4, UNSERVED_HDIM)
    with pytest.raises(fmha.MissingInstanceError) as miss:
        fmha.select_bwd(q, q, q, causal=True, capability=H100)
    assert_whole_miss(str(miss.value), UNSERVED_HDIM)
    assert "bwd," in str(miss.value)  # the filter selects backward instances


def test_kvcache_miss_is_an_exception_with_the_whole_message():
    needs_a_miss(fmha.kvcache_instances())
    q, cache = meta(2, 1, 8, UNSERVED_HDIM), meta(2, 256, 2, UNSERVED_HDIM)
    lengths = torch.empty(2, dtype=torch.int32, device="meta")
    with pytest.raises(fmha.MissingInstanceError) as miss:
        fmha.select_kvcache(q, cache, cache, cache_seqlens=lengths, capability=H100)
    assert_whole_miss(str(miss.value), UNSERVED_HDIM)
    assert "kvcache," in str(miss.value)


def test_cpp_checks_format_their_numbers():
    """An argument check of the C++ API formats integers into its message too."""
    from fmha import _C
    args = _C.FwdArgs()
    args.batch, args.seqlen_q, args.seqlen_k = 1, 16, 16
    args.nhead_q, args.nhead_k, args.hdim_q, args.hdim_v = 3, 2, 64, 64
    code, message, _ = _C.select(args, 90)
    assert code == _C.STATUS_INVALID_ARGUMENT
    assert message.endswith("nhead_q (3) must be a positive multiple of nhead_k (2)"), message


@pytest.mark.parametrize("capability,error", [((9,), TypeError), ("sm90", TypeError),
                                              ((0, 0), ValueError), ((9, 10), ValueError)])
def test_a_bad_capability_is_refused(capability, error):
    q = meta(1, 16, 2, 64)
    with pytest.raises(error, match="fmha.select: capability must be"):
        fmha.select(q, q, q, capability=capability)
