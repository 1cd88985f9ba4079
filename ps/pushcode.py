"""``PushCode``: one key's compressed push frame, handed to the update rule undecoded.

A shard decodes a compressed push into the key's scratch array before the mode and the rule see
it (``ps.checks.decode_push``). Where the rule reads the code itself, in the kernel that makes
the update (1-bit Adam, every layout: ``native.publish``'s ``_code`` kernels; Adam and AdamW:
``native.coded``), that decode is a write and a read of a key-long array the update does not
need. ``ShardCore.keeps_code`` says where a push stays a code; everywhere else it is decoded as
before.

Contract: a ``PushCode`` reaches only a rule whose :meth:`~ps.rules.UpdateRule.takes_code` said
yes for its codec, through a mode whose ``Consistency.takes_codes`` is true: async/ssp apply each
push on its own (with no compensation reading its values); sync sums a step's pushes in the
key's store (``Slot.accumulate``): a step's only push stays a code; two or more stay codes
together (:class:`PushCodes`, in rank order) where the rule reads such a sum in its kernel
(``Slot.sums_codes``: sync 1-bit Adam), and are otherwise decoded into the sum as they are
added (:meth:`PushCode.add_to`). Its frame passed the codec's length check
and the finiteness check (read from the payload: ``CodecKind.payload_finite``) and is read only;
the ``PushCode`` keeps it alive, as a raw push's view does (a sync step's pending push outlives
its request). A rule that needs the values after all calls ``decoded`` (both classes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bitps.native import sign1
from bitps.proto.codecs import Codec

__all__ = ["PushCode", "PushCodes"]


@dataclass(frozen=True, slots=True)
class PushCode:
    """A key's push as it came: ``frame`` (``codec``'s payload of ``n`` elements)."""

    codec: Codec
    frame: memoryview | bytes
    n: int

    def decoded(self, out: np.ndarray) -> np.ndarray:
        """The float32 values, written to ``out[:n]`` (returned): what ``decode_push`` gave."""
        return self.codec.decode(self.frame, self.n, out)

    def add_to(self, acc: np.ndarray) -> None:
        """``acc += `` the values, bit for bit adding what :meth:`decoded` gives."""
        self.codec.add_decoded(self.frame, self.n, acc)

    def sign1_sections(self) -> tuple[np.ndarray, np.ndarray, np.int64]:
        """A sign1 push's scales and sign bits (views of the frame, ``native.sign1.split``)
        and its chunk: what the kernels that read a code take (``native.publish``'s
        ``_code`` kernels, ``native.coded``)."""
        scales, bits = sign1.split(self.frame, self.n, self.codec.chunk)
        return scales, bits, np.int64(self.codec.chunk)


@dataclass(frozen=True, slots=True)
class PushCodes:
    """A sync step's pushes still in their codes, ``codes`` in rank order (two or more, one
    codec): their sum is the float32 values of the first plus each next one's, added in that
    order (what ``Slot.accumulate`` makes of them when it decodes), and the rule's kernel reads
    it block by block without a key-long sum written and read again."""

    codes: tuple[PushCode, ...]

    @property
    def codec(self) -> Codec:
        return self.codes[0].codec

    @property
    def n(self) -> int:
        return self.codes[0].n

    def then(self, code: PushCode) -> PushCodes:
        """These codes and ``code`` (the next rank's) after them."""
        return PushCodes((*self.codes, code))

    def decoded(self, out: np.ndarray) -> np.ndarray:
        """The sum's float32 values in ``out[:n]`` (returned): the first code decoded, the
        others added in order, bit for bit the sum ``Slot.accumulate`` decodes."""
        first, *rest = self.codes
        values = first.decoded(out)
        for code in rest:
            code.add_to(values)
        return values

    def sign1_sections(self) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...], np.int64]:
        """Every code's scales and sign bits (:meth:`PushCode.sign1_sections`) and the codec's
        chunk: what ``native.onebit_sync_publish_code`` takes. numba needs one array type per
        tuple: frames of mixed kinds (a bytes object and a writable buffer) are all given as
        read-only views."""
        sections = [code.sign1_sections()[:2] for code in self.codes]
        scales, bits = zip(*sections)
        if len({a.flags.writeable for a in (*scales, *bits)}) > 1:
            scales, bits = tuple(map(_read_only, scales)), tuple(map(_read_only, bits))
        return tuple(scales), tuple(bits), np.int64(self.codec.chunk)


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view
