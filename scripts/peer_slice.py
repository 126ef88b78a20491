"""A pytest plugin that keeps the parametrized cases of a peer's suite whose parameters have the
values PEER_PARAMS names, and deselects the rest: FlashAttention-2's suite has 508,777 cases,
and `-k` matches substrings of case ids, which cannot say "head dim 128" exactly.

    PYTHONPATH=scripts PEER_PARAMS=d=128,seqlen=200 python -m pytest -q -p peer_slice \\
        ../shared/peer-tests/flash_attn -k test_flash_attn_qkvpacked

A parameter a case does not have does not deselect it; values compare as their str().

Under pytest-xdist (`-n N`), each worker takes one GPU of the machine, worker i the GPU
i mod the number of GPUs (PEER_GPUS, default 1), so `-n 4` on 4 GPUs runs four cases at once.
"""

import os


def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...: set in xdist's workers
    if worker:
        # Before anything initialises CUDA: the suite's module imports torch but touches no GPU
        # until its first test.
        gpus = int(os.environ.get("PEER_GPUS", "1"))
        os.environ["CUDA_VISIBLE_DEVICES"] = str(int(worker[2:]) % gpus)


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
