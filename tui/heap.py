"""The garbage-collection policy of both processes: no full collection in the middle of a reply."""

from __future__ import annotations

import gc


def settle_heap(full: bool = False) -> None:
    """Take what exists now out of the cyclic GC's reach (gc.freeze), so no full collection runs
    mid-reply.

    A full (generation 2) collection walks every tracked object, and with torch, transformers and
    Textual loaded that is long enough to be seen as one slow step. It runs in whichever thread
    allocates, the engine's too. So this is called between replies, in the app's process and in
    the engine's. `full` first unfreezes and collects everything, so the garbage of a cleared chat
    is freed rather than frozen; otherwise only the young generations are collected before
    freezing.
    """
    if full:
        gc.unfreeze()
        gc.collect()
    else:
        gc.collect(1)
    gc.freeze()
