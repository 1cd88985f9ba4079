from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class OneBitParams(_message.Message):
    __slots__ = ("freeze_step", "chunk", "codec_flags", "lr", "beta1", "eps", "weight_decay", "ratio_clip", "beta2", "worker_moments", "lr_warmup_steps", "lr_decay_steps", "lr_min_ratio", "momentum_per_update")
    FREEZE_STEP_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CODEC_FLAGS_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    RATIO_CLIP_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    WORKER_MOMENTS_FIELD_NUMBER: _ClassVar[int]
    LR_WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    LR_DECAY_STEPS_FIELD_NUMBER: _ClassVar[int]
    LR_MIN_RATIO_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_PER_UPDATE_FIELD_NUMBER: _ClassVar[int]
    freeze_step: int
    chunk: int
    codec_flags: int
    lr: float
    beta1: float
    eps: float
    weight_decay: float
    ratio_clip: float
    beta2: float
    worker_moments: bool
    lr_warmup_steps: int
    lr_decay_steps: int
    lr_min_ratio: float
    momentum_per_update: bool
    def __init__(self, freeze_step: _Optional[int] = ..., chunk: _Optional[int] = ..., codec_flags: _Optional[int] = ..., lr: _Optional[float] = ..., beta1: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., ratio_clip: _Optional[float] = ..., beta2: _Optional[float] = ..., worker_moments: _Optional[bool] = ..., lr_warmup_steps: _Optional[int] = ..., lr_decay_steps: _Optional[int] = ..., lr_min_ratio: _Optional[float] = ..., momentum_per_update: _Optional[bool] = ...) -> None: ...
