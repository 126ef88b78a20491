"""A pytest plugin that keeps the parametrized cases of a peer's suite whose parameters have the
values PEER_PARAMS names, and deselects the rest: FlashAttention-2's suite has 508,777 cases,
and `-k` matches substrings of case ids, which cannot say "head dim 128" exactly.

    PYTHONPATH=scripts PEER_PARAMS=d=128,seqlen=200 python -m pytest -q -p peer_slice \\
        ../shared/peer-tests/flash_attn -k test_flash_attn_qkvpacked

A parameter a case does not have does not deselect it; values compare as their str().
"""

import os


def _wanted() -> dict:
    pairs = [item.split("=", 1) for item in os.environ.get("PEER_PARAMS", "").split(",") if item]
    return {name.strip(): value.strip() for name, value in pairs}


def pytest_collection_modifyitems(config, items):
    wanted = _wanted()
    if not wanted:
        return
    kept, deselected = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        matches = all(str(params[name]) == value for name, value in wanted.items()
                      if name in params)
        (kept if matches else deselected).append(item)
    config.hook.pytest_deselected(items=deselected)
    items[:] = kept
