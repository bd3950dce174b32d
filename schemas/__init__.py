"""The contract: Avro schemas (`avro/*.avsc`), the codec and the pydantic event models.

Every other part imports events from here: `from schemas import encode, decode, events`.
"""

from schemas.codec import Codec, decode, encode, default_codec
from schemas import models as events  # noqa: E402

__all__ = ["Codec", "decode", "encode", "default_codec", "events"]
