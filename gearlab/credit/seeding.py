"""Per-row seeds for randomised controls (``gear`` with ``segmentation=random``, ``shuffle``): a row's random draw
depends on its own tokens only, so the same response gets the same draw wherever it sits in a batch."""
from __future__ import annotations

import hashlib
import struct

from gearlab.core.batch import RolloutBatch

__all__ = ["row_seeds"]


def row_seeds(batch: RolloutBatch, control_seed: int) -> list[int]:
    """One 63-bit seed per row: BLAKE2b (8 bytes, person "gearlab-control") of ``control_seed``, then the row's real
    prompt ids and its real response ids (prompt_mask / attention_mask; each list length-prefixed), all as
    little-endian int64. Independent of the row's position, its padding and the other rows."""
    prompt, pmask = batch.prompt_ids.cpu().numpy(), batch.prompt_mask.cpu().numpy().astype(bool)
    resp, rmask = batch.response_ids.cpu().numpy(), batch.attention_mask.cpu().numpy().astype(bool)
    out = []
    for i in range(resp.shape[0]):
        h = hashlib.blake2b(digest_size=8, person=b"gearlab-control")
        h.update(struct.pack("<q", int(control_seed)))
        for ids in (prompt[i][pmask[i]], resp[i][rmask[i]]):
            h.update(struct.pack("<q", ids.size))
            h.update(ids.astype("<i8").tobytes())
        out.append(int.from_bytes(h.digest(), "little") & ((1 << 63) - 1))
    return out
