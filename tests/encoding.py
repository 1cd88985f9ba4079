"""``EncodingClient``: a ``PSClient`` with its ``Encoder``, for tests that push by hand with a
push codec or 1-bit Adam. Issue 25 moved compression out of the transport
(``worker.training.encoder``); these tests drive both as one object, so that what they assert
stays as it was: pushes, registration and the encoder's state go to the encoder, everything else
(pulls, recovery, versions, metrics, close) to the client."""

from __future__ import annotations

from bitps.worker.config import ClientConfig, EncoderConfig
from bitps.worker.training.encoder import Encoder
from bitps.worker.transport.client import PSClient

__all__ = ["EncodingClient"]

_ENCODER = frozenset({"register", "push", "push_pull", "encode", "codec_at", "compresses",
                      "clip_correct", "refuse_nonfinite", "residuals",
                      "load_residuals", "policy_state", "load_policy_state", "state_dict",
                      "load_state_dict", "chooses_codecs", "policy", "pull_codec"})


class EncodingClient:
    """``PSClient(cfg)`` and ``Encoder(encoder or the cfg's compression settings, client)``."""

    def __init__(self, cfg: ClientConfig, *, encoder: EncoderConfig | None = None,
                 **kw) -> None:
        client = PSClient(cfg, **kw)
        object.__setattr__(self, "transport", client)
        object.__setattr__(self, "encoder",
                           Encoder(encoder or EncoderConfig.from_client(cfg), client))

    def __getattr__(self, name: str):
        return getattr(self.encoder if name in _ENCODER else self.transport, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.transport, name, value)

    def push_codec_at(self, clock: int):
        return self.encoder.codec_at(clock)

    def __enter__(self) -> EncodingClient:
        return self

    def __exit__(self, *exc) -> None:
        self.encoder.close()
        self.transport.close()
