"""The engine's records on their way to a watcher: batched with the block map as a delta, and
written as JSON for watchers in another process or on another machine.

A batch is (events, delta): the events with their block snapshots taken out, and the newest
snapshot as a delta from the one last sent (the block map keeps unchanged BlockInfos as the same
objects, so the delta is the blocks that are not). The app's engine process pickles batches; a
server writes each batch once as JSON (`dumps`) and sends the same text to every watcher.
"""

from __future__ import annotations

import itertools
import json
import operator
import time
from dataclasses import fields, is_dataclass, replace

import torch
from pagechat.core.blockmap import BlockInfo, BlockSnapshot
from pagechat.core.blocks import BlockEvent
from pagechat.core.events import (
    BlocksChanged,
    EngineInfo,
    Finished,
    FirstToken,
    MemoryRead,
    Started,
)
from pagechat.core.memory import EngineMemory, Readings, WeightReport, WeightRow
from pagechat.core.params import Constraint, SamplingParams
from pagechat.core.report import (
    BatchItem,
    BeamResult,
    DraftRecord,
    SeqRecord,
    SpecTotals,
    StepReport,
    SwapRecord,
    TokenOutput,
)
from pagechat.core.roofline import Roofline
from pagechat.core.sampler import Candidate, SampleRecord

FLUSH_HZ = 20  # batches a second at most while decoding; the UI draws at most this often
BEAT_S = 0.25  # a watcher hears something at least this often, a heartbeat when nothing else
SILENT_S = 1.5  # an engine silent this long has stopped answering (hung, stopped, or gone)
MEMORY_EVERY_S = 1.0  # a loop sends a memory reading this often while the engine works

# (the new snapshot with no blocks, the BlockInfos that changed)
Delta = tuple[BlockSnapshot, tuple]
Batch = tuple[list, Delta | None]

# every record a batch or an EngineInfo holds, by the name JSON gives it
RECORDS = {
    cls.__name__: cls
    for cls in (
        StepReport,
        TokenOutput,
        SampleRecord,
        Candidate,
        SamplingParams,
        Constraint,
        BlockSnapshot,
        BlockInfo,
        BlockEvent,
        DraftRecord,
        SpecTotals,
        SwapRecord,
        SeqRecord,
        BatchItem,
        BeamResult,
        Started,
        FirstToken,
        Finished,
        BlocksChanged,
        MemoryRead,
        Readings,
        EngineInfo,
        EngineMemory,
        WeightReport,
        WeightRow,
        Roofline,
    )
}
_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in RECORDS.values()}


class Outbox:
    """Events waiting to go to a watcher, and when they are due as a batch: at once when one of
    them is `urgent` (a watcher shows it without waiting for the next tick) or the engine went
    idle, else at most FLUSH_HZ times a second, so that sending costs the engine a few batches a
    second rather than a message per step."""

    def __init__(self, urgent: tuple[type, ...]) -> None:
        self.urgent_types = urgent
        self.events: list = []
        self._urgent = False
        self._last = 0.0

    def add(self, ev) -> None:
        self.events.append(ev)
        self._urgent = self._urgent or isinstance(ev, self.urgent_types)

    def take(self, idle: bool) -> list | None:
        """The events, when a batch is due; None otherwise."""
        now = time.perf_counter()
        if not self.events or not (idle or self._urgent or now - self._last >= 1 / FLUSH_HZ):
            return None
        out, self.events, self._urgent, self._last = self.events, [], False, now
        return out


def blocks_delta(old: BlockSnapshot, new: BlockSnapshot) -> Delta:
    """What turns `old` into `new`: the totals and every block record that is not old's own
    object."""
    changed = tuple(itertools.compress(new.blocks, map(operator.is_not, new.blocks, old.blocks)))
    return replace(new, blocks=()), changed


def apply_delta(old: BlockSnapshot, delta: Delta) -> BlockSnapshot:
    totals, changed = delta
    blocks = list(old.blocks)
    for info in changed:
        blocks[info.block_id] = info
    return replace(totals, blocks=tuple(blocks))


def pack(events: list, sent: BlockSnapshot) -> tuple[Batch, BlockSnapshot]:
    """A batch to send: the events with their snapshots taken out, and the newest snapshot as a
    delta from `sent`."""
    snap, out = sent, []
    for ev in events:
        if isinstance(ev, StepReport):
            snap, ev = ev.blocks, replace(ev, blocks=None)
        elif isinstance(ev, BlocksChanged):
            snap, ev = ev.snapshot, replace(ev, snapshot=None)
        out.append(ev)
    return (out, None if snap is sent else blocks_delta(sent, snap)), snap


def unpack(batch: Batch, held: BlockSnapshot) -> tuple[list, BlockSnapshot]:
    """The events of a batch, each snapshot field set to the batch's newest snapshot (the UI draws
    only that)."""
    events, delta = batch
    snap = held if delta is None else apply_delta(held, delta)
    out = []
    for ev in events:
        if isinstance(ev, StepReport):
            ev = replace(ev, blocks=snap)
        elif isinstance(ev, BlocksChanged):
            ev = replace(ev, snapshot=snap)
        out.append(ev)
    return out, snap


# -- JSON ------------------------------------------------------------------------------------------
def _plain(obj):
    """obj as JSON values: a record as {"_": its name, field: value...}, a tuple as a list."""
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, (tuple, list)):
        return [_plain(x) for x in obj]
    if isinstance(obj, torch.device):
        return {"_": "device", "type": str(obj)}
    if is_dataclass(obj) and type(obj) in _FIELDS:
        out = {"_": type(obj).__name__}
        for name in _FIELDS[type(obj)]:
            out[name] = _plain(getattr(obj, name))
        return out
    raise TypeError(f"{type(obj).__name__} is not a record the wire carries")


def _tuples(value):
    return tuple(_tuples(x) for x in value) if isinstance(value, list) else value


def _record(d: dict):
    """json's object hook: a record back from its dict (its lists back to tuples)."""
    name = d.get("_")
    if name is None:
        return d
    if name == "device":
        return torch.device(d["type"])
    cls = RECORDS.get(name)
    if cls is None:
        raise ValueError(f"unknown record {name!r}: another pagechat version wrote it")
    try:
        return cls(**{k: _tuples(v) for k, v in d.items() if k != "_"})
    except TypeError:  # fields added or gone
        raise ValueError(f"a {name} record of another pagechat version") from None


def dumps(obj) -> str:
    """obj (a batch, a record, or lists and tuples of them) as one line of JSON."""
    return json.dumps(_plain(obj), separators=(",", ":"))


def loads(text: str):
    """What dumps wrote, with its records and tuples rebuilt (a top-level batch as a list)."""
    return json.loads(text, object_hook=_record)
