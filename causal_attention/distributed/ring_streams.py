"""What travels along the ring during a pass: the receives of a stream posted a step ahead
(inbox), the send in flight (outbox), and the K/V parts passed on from rank to rank."""

from typing import List, Sequence

from torch import Tensor

from .ring_schedule import _Ring, _Unit


def _wait(works) -> None:
    for work in works:
        work.wait()


class _Inbox:
    """The receives of one stream from one peer, posted a step ahead: the receive of unit i + P
    (the same part, next step) when unit i is taken, so that it is posted when the peer sends it
    (a large message waits for its receive), sized by the part's sender's shard (``like`` gives
    the other dims). Units of step 0 are this rank's own."""

    def __init__(self, ring: _Ring, stream: int, source: int, like, dtype=None):
        self.ring, self.stream, self.source = ring, stream, source
        self.like, self.dtype = like, dtype
        self.pending = {}
        for i in range(ring.parts):
            self.post(i + ring.parts)

    def post(self, i: int) -> None:
        units = self.ring.units
        if i < len(units) and units[i].step > 0 and i not in self.pending:
            self.pending[i] = self.ring.receive(self.like, self.ring.part_rows(units[i]),
                                                self.source, self.stream, units[i], self.dtype)

    def take(self, i: int) -> List[Tensor]:
        """Unit i's tensors, once here; posts the receive of unit i + P."""
        self.post(i + self.ring.parts)
        buffers, works = self.pending.pop(i)
        _wait(works)
        return buffers


class _Outbox:
    """The send in flight, with the tensors it reads: waited for when the next one starts (the
    peer posted its receive a step ahead), so one unit's tensors outlive its computation."""

    def __init__(self):
        self.in_flight = None

    def send(self, works_and_tensors) -> None:
        self.finish()
        self.in_flight = works_and_tensors

    def finish(self) -> None:
        if self.in_flight is not None:
            _wait(self.in_flight[0])
            self.in_flight = None


class _KVStream:
    """The K/V parts of a pass along the ring, in unit order: this rank's own at step 0, then
    each received from the previous rank, and passed on to the next rank as soon as it is here."""

    def __init__(self, ring: _Ring, k: Tensor, v: Tensor):
        self.ring = ring
        self.own = [(ring.own_part(k, p), ring.own_part(v, p)) for p in range(ring.parts)]
        self.inbox = _Inbox(ring, 0, ring.prev, (k, v))
        self.outbox = _Outbox()

    def get(self, i: int) -> Sequence[Tensor]:
        """Unit i's K and V, passed on to the next rank."""
        ring, unit = self.ring, self.ring.units[i]
        kv = self.own[unit.part] if unit.step == 0 else self.inbox.take(i)
        if unit.step + 1 < ring.steps:
            self.outbox.send(ring.send(kv, ring.next, 0, _Unit(unit.step + 1, unit.part)))
        return kv

    def finish(self) -> None:
        self.outbox.finish()
