"""What the GPU test modules share: skipping the whole module when there is no GPU or no usable
fmha build, and which compiled instances this GPU runs."""

from __future__ import annotations

import pytest

# The functional traits of an instance (fmha::FwdTraits), as fmha.instances() spells them.
TRAIT_KEYS = ("dtype", "hdim_q", "hdim_v", "mask", "bias", "vlayout", "mode", "lse", "dropout",
              "softcap")


def import_fmha():
    """(torch, fmha) for a GPU test module; call it at module level: without a GPU, an
    importable fmha, or an fmha that has this API, it skips the whole module saying which."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)",
                    allow_module_level=True)
    try:
        import fmha
    except Exception as exc:  # not built, or a build that does not load
        pytest.skip(f"the fmha module is not importable: {exc!r}", allow_module_level=True)
    missing = [n for n in ("fwd", "instances", "select", "dropout_mask", "MissingInstanceError")
               if not hasattr(fmha, n)]
    if missing:
        pytest.skip(f"fmha at {getattr(fmha, '__file__', '?')} predates the API these tests "
                    f"target (no {', '.join(missing)}); rebuild it", allow_module_level=True)
    return torch, fmha


def device_cc(torch) -> int:
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def runs_here(inst: dict, cc: int) -> bool:
    """Whether this GPU runs the instance, by the instance's own target (fmha.instances())."""
    return cc == inst["arch_cc"] if inst["arch_exact"] else cc >= inst["arch_cc"]
