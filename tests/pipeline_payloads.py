"""What a pipeline carries to its workers, read back from its portable proto (for tests that search it)."""

from __future__ import annotations

import base64
import bz2
import zlib
from typing import Any

__all__ = ["pickled_dofns"]


def pickled_dofns(proto: Any) -> list[bytes]:
    """Every ParDo's serialized DoFn, uncompressed (Beam's pickler: base64 of zlib or bz2)."""
    from apache_beam.portability import common_urns
    from apache_beam.portability.api import beam_runner_api_pb2

    out = []
    for transform in proto.components.transforms.values():
        if transform.spec.urn != common_urns.primitives.PAR_DO.urn:
            continue
        payload = beam_runner_api_pb2.ParDoPayload.FromString(transform.spec.payload).do_fn.payload
        raw = base64.b64decode(payload)
        for decompress in (zlib.decompress, bz2.decompress):
            try:
                out.append(decompress(raw))
                break
            except (OSError, ValueError, zlib.error):
                continue
    assert out, "no ParDo payload could be read"
    return out
