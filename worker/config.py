"""Worker configuration: keyword-only dataclasses, one docstring per field, validated on creation.

Each default is written here once, and each field with a fixed set of values lists them in its
``metadata["choices"]`` (the tuple ``__post_init__`` checks); ``worker/__main__.py`` turns the
fields into ``bitps-worker``'s flags, environment variables and config-file keys through
``bitps.proto.settings``, which reads both from the fields.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from bitps.proto.codecs import CodecConfig
from bitps.proto.keyplan import DEFAULT_PARTITION_BYTES
from bitps.proto.registry import Registry
from bitps.proto.settings import Setting, from_field

__all__ = ["ALGORITHMS", "TRAINERS", "AlgorithmConfig", "ClientConfig", "EncoderConfig",
           "OverlapConfig", "PoolConfig", "RunConfig"]

OVERLAP_MODES = ("auto", "on", "off")
HOLD_MODES = ("sync", "on", "off")


AUTO_CLIP = -1.0
"""``EncoderConfig.clip_norm``'s default: clip compressed pushes at :data:`COMPRESSED_CLIP_NORM`,
float32 ones not at all."""
COMPRESSED_CLIP_NORM = 1.0
"""The norm :data:`AUTO_CLIP` clips compressed pushes to: sign1 and 1-bit Adam train the demo
model and the e2e models with it (error feedback carries what a gradient spike would leave)."""


def check_clip_norm(value: float) -> None:
    """``ValueError`` unless ``value`` is a norm (>= 0; 0 = off) or :data:`AUTO_CLIP`."""
    if not (value >= 0 or value == AUTO_CLIP):
        raise ValueError(f"clip_norm must be >= 0 (0 = no clipping) or {AUTO_CLIP:g} (auto: "
                         f"{COMPRESSED_CLIP_NORM:g} for compressed pushes, none for float32 "
                         f"ones), got {value}")


@dataclass(kw_only=True, frozen=True)
class ClientConfig:
    """How a worker rank reaches the shards."""

    servers: tuple[str, ...]
    """gRPC ``host:port`` of every shard, in shard-id order."""
    rank: int = 0
    """This worker's rank, 0 .. world_size-1 (rank 0 sends the initial parameters)."""
    world_size: int = 1
    """Number of worker ranks."""
    initializes: bool | None = None
    """Whether this worker sends the initial values of the keys it registers, at registration
    and to a shard that came back empty (``PSClient.recover``). ``None``: rank 0 does. In a
    pipeline each stage registers its own keys, so replica 0 of every stage sends them; for
    each key, exactly one worker should."""
    token: str = ""
    """Shared secret the shards expect (empty = none)."""
    deadline_s: float = 60.0
    """Longest any push/pull may wait for its answer before a typed timeout error."""
    register_timeout_s: float = 120.0
    """Longest Register may wait (other ranks wait there for rank 0's initial values)."""
    heartbeat_s: float = 1.0
    """Interval between heartbeats to every shard."""
    reconnect_timeout_s: float = 60.0
    """Longest a worker tries to get a lost shard back (a push/pull timed out, or the shard
    answers ``NOT_REGISTERED``: it restarted): re-register and redo the step's exchange with it
    (``PSClient.complete``). Past this, ``ShardLostError`` names the shard and how long it
    tried."""
    reconnect_backoff_s: float = 0.05
    """First pause between attempts to re-register with a lost shard (and gRPC's first
    reconnect backoff); each next pause doubles, up to ``reconnect_backoff_max_s``."""
    reconnect_backoff_max_s: float = 2.0
    """Longest pause between attempts to re-register with a lost shard (and gRPC's longest
    reconnect backoff), so a shard back after a restart is found within this long."""
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    """Largest key: tensors are cut into partitions of at most this many bytes."""
    message_bytes: int = 256 << 10
    """Keys going to one shard are batched into data messages of at most this many bytes on the
    wire (each key counted at the larger of its payload, a compressed one at its code's size,
    and its reply, a coded one at the size it last had): small and compressed keys share a
    message to amortise the per-message cost (~100 us of Python per side here), and a larger
    key travels alone, so the shard updates one key while the next arrives."""

    # Deprecated: compression settings are the encoder's (EncoderConfig); these aliases keep
    # ClientConfig(push_codec=...) working for one release (CHANGELOG.md). PSModel reads them
    # only when it is given no EncoderConfig; the transport never does.
    push_codec: CodecConfig = field(default_factory=CodecConfig)
    """Deprecated: :attr:`EncoderConfig.push_codec`."""
    pull_codec: CodecConfig | None = None
    """Deprecated: :attr:`EncoderConfig.pull_codec`."""
    compress_min_bytes: int = 1 << 20
    """Deprecated: :attr:`EncoderConfig.compress_min_bytes`."""
    clip_norm: float = AUTO_CLIP
    """Deprecated: :attr:`EncoderConfig.clip_norm`."""
    codec_seed: int = 0
    """Deprecated: :attr:`EncoderConfig.codec_seed`."""
    curve_server_key: str = ""
    """The shards' CURVE public key, a ``.key`` file (``bitps-keygen``); with
    ``curve_client_key`` the data plane is encrypted and the shards authenticate this worker
    (docs/security.md). Must match the shards' ``curve_secret_key``; empty: plain ZeroMQ."""
    curve_client_key: str = ""
    """This worker's CURVE key pair, a ``.key_secret`` file whose public key is in the shards'
    ``curve_allowed_keys``."""
    tls_ca_file: str = ""
    """CA certificates (PEM) the shards' TLS certificates must be signed by; non-empty turns
    TLS on for the gRPC control plane (the host in ``servers`` must be in the certificate).
    Empty: plaintext gRPC."""
    tls_cert_file: str = ""
    """With TLS: this worker's certificate chain (PEM), for shards that require client
    certificates (``tls_client_ca_file``); needs ``tls_key_file``."""
    tls_key_file: str = ""
    """The private key (PEM) of ``tls_cert_file``."""

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("servers must name at least one shard as host:port")
        for s in self.servers:
            host, _, port = s.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"server {s!r} is not host:port")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        for attr in ("deadline_s", "register_timeout_s", "heartbeat_s", "reconnect_timeout_s",
                     "reconnect_backoff_s"):
            if not getattr(self, attr) > 0:
                raise ValueError(f"{attr} must be > 0, got {getattr(self, attr)}")
        if not self.reconnect_backoff_max_s >= self.reconnect_backoff_s:
            raise ValueError(f"reconnect_backoff_max_s must be >= reconnect_backoff_s "
                             f"({self.reconnect_backoff_s}), got {self.reconnect_backoff_max_s}")
        if self.compress_min_bytes < 0:
            raise ValueError(f"compress_min_bytes must be >= 0, got {self.compress_min_bytes}")
        check_clip_norm(self.clip_norm)
        if self.partition_bytes < 1024 or self.message_bytes < 1024:
            raise ValueError(f"partition_bytes and message_bytes must be >= 1024, got "
                             f"{self.partition_bytes} and {self.message_bytes}")
        self._check_security()

    def _check_security(self) -> None:
        """Settings that only work together (the files are read by ``PSClient``)."""
        if bool(self.curve_server_key) != bool(self.curve_client_key):
            raise ValueError(f"curve_server_key {self.curve_server_key!r} and "
                             f"curve_client_key {self.curve_client_key!r}: expected both "
                             f"(CURVE on) or neither")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError(f"tls_cert_file {self.tls_cert_file!r} and tls_key_file "
                             f"{self.tls_key_file!r}: expected both or neither")
        if self.tls_cert_file and not self.tls_ca_file:
            raise ValueError(f"tls_cert_file {self.tls_cert_file!r} given without tls_ca_file; "
                             f"expected TLS on (tls_ca_file) to present a client certificate")


_COMPRESSION_FIELDS = ("push_codec", "pull_codec", "compress_min_bytes", "clip_norm",
                       "codec_seed")


@dataclass(kw_only=True, frozen=True)
class EncoderConfig:
    """How a worker turns gradients into pushes (``worker.training.encoder.Encoder``)."""

    push_codec: CodecConfig = field(default_factory=CodecConfig)
    """How gradients are pushed (``proto.codecs``): ``raw`` float32 by default; ``bf16``,
    ``fp16``, ``sign1`` or ``sparse`` compress each key with error feedback kept per key."""
    pull_codec: CodecConfig | None = None
    """How the shards publish parameter updates for pulls (``ps.publish``): each update is
    compressed with the shards' own error feedback and applied to their copy, a pull carries
    the codes since the worker's version, and the worker applies them, so both hold the same
    parameters bit for bit (a worker too far behind gets float32). ``None``: the push codec's
    (``raw``: float32 parameters). Every worker must pull alike; a ``onebit_adam`` shard always
    publishes its own sign1 codes. Tensors under ``compress_min_bytes`` pull float32."""
    compress_min_bytes: int = 1 << 20
    """Tensors smaller than this many (float32) bytes are pushed raw even with a push codec
    (for small messages the per-message cost dominates and compressing gains nothing); every key
    of a tensor at least this large is compressed, whatever size ``partition_bytes`` cut it to."""
    clip_norm: float = AUTO_CLIP
    """The global L2 norm the encoder clips each step's local gradient to before its push and
    error feedback, as ``clip_grad_norm_`` would (under overlap, the only place a push can be
    clipped: buckets leave before ``step()``). 0: no clipping. :data:`AUTO_CLIP` (-1, the
    default): :data:`COMPRESSED_CLIP_NORM` (1.0) when pushes are compressed (a push codec, or
    1-bit Adam), none for float32 pushes, as torch clips nothing unless asked. A norm given
    clips every push, float32 ones too."""
    codec_seed: int = 0
    """Seed of the sparse codec's sampling and stochastic rounding (mixed with rank, key and
    step, so runs repeat exactly)."""
    threads: int = 1
    """Threads that check and encode one push's keys at once (``native.keypool.KeyPool``: the
    calling thread and ``threads - 1`` helpers; 0 = one per core this process may run on); a
    push whose keys hold less than ``native.keypool.MIN_SPLIT_BYTES`` together stays on the
    calling thread. The payloads are the same bits with any number. 1 by default: a worker's
    host cores also run its training (on a CPU run they are the compute's); raise it where they
    sit idle during the step, as on a GPU host (``bitps-bench kernels``' encoder scaling,
    docs/benchmarks.md)."""

    def __post_init__(self) -> None:
        if self.compress_min_bytes < 0:
            raise ValueError(f"compress_min_bytes must be >= 0, got {self.compress_min_bytes}")
        check_clip_norm(self.clip_norm)
        if self.threads < 0:
            raise ValueError(f"encoder threads must be >= 0 (0: one per core), got "
                             f"{self.threads}")

    def clip_norm_for(self, *, compressed: bool) -> float:
        """The norm a run clips to (0: none), :data:`AUTO_CLIP` resolved: ``compressed``, its
        pushes are compressed (a push codec, or a policy that picks codecs, as 1-bit Adam)."""
        if self.clip_norm == AUTO_CLIP:
            return COMPRESSED_CLIP_NORM if compressed else 0.0
        return self.clip_norm

    @classmethod
    def from_client(cls, cfg: ClientConfig) -> EncoderConfig:
        """The compression settings a (deprecated) ``ClientConfig`` still carries; a
        ``DeprecationWarning`` when any differs from its default."""
        values = {name: getattr(cfg, name) for name in _COMPRESSION_FIELDS}
        default = cls()
        if changed := [n for n, v in values.items() if v != getattr(default, n)]:
            warnings.warn(f"ClientConfig.{', '.join(changed)}: compression settings moved to "
                          f"EncoderConfig (pass PSModel(..., encoder=EncoderConfig(...)))",
                          DeprecationWarning, stacklevel=3)
        return cls(**values)


@dataclass(kw_only=True, frozen=True)
class OverlapConfig:
    """How ``PSModel`` overlaps gradient exchange with compute (``worker.training.comm``)."""

    mode: str = field(default="auto", metadata={"choices": OVERLAP_MODES})
    """``on``: push each bucket from backward hooks on the communication thread and wait for
    its parameters in the forward pre-hook of the module that owns them; ``off``: push and pull
    everything in ``step()``; ``auto``: measure the first steps with overlap off, then turn it
    on when communication takes more than ``min_ratio`` of compute (the problem statement's
    rule). The decision and the measured ratio are logged and exported."""
    min_ratio: float = 0.2
    """``auto`` turns overlap on when (communication time / compute time) exceeds this."""
    probe_steps: int = 3
    """Steps ``auto`` measures (after one warm-up step) before deciding; the median counts, so
    it decides as soon as more than half of them fall on one side of ``min_ratio``."""
    bucket_bytes: int = 1 << 20
    """Parameters are grouped, in reverse registration order (the order backward produces
    their gradients), into buckets closed once they hold this many float32 bytes or more; a
    bucket is pushed once every gradient in it is ready."""
    inflight_bytes: int = 2 << 20
    """Credit window: the communication thread starts no new bucket while this many gradient
    bytes are in flight (one bucket always may go). Small enough that buckets wait in the
    thread's priority queue rather than in socket buffers, so front layers can overtake; large
    enough to keep the link busy (about two buckets: one being pushed while one is answered).
    ``bitps-bench overlap`` measured 4 MiB (four buckets) at 1 Gbit/s exposing twice the wait."""
    hold_when_clipping: str = field(default="sync", metadata={"choices": HOLD_MODES})
    """With clipping in force (``ClientConfig.clip_norm``), ``on``: a step that follows a
    clipped step (or a worker's first) pushes nothing from backward's hooks; ``step()`` pushes
    it whole with the exact clip factor, as overlap off does. Buckets pushed before the step's
    norm is known carry a predicted factor whose error reaches the shards one step late
    (``worker.training.clip``), which cost sync 1-bit Adam on the e2e MoE 3.7 % of final
    loss. ``sync``: ``on`` where the shards hold pulls for the other workers' pushes (sync with
    more than one worker) and pushes are compressed, ``off`` elsewhere: async 1-bit Adam on the
    e2e LM ended 2.2 % higher with the hold, and sync fp32 runs held (clipped at DDP's norm)
    reached DDP fp32's target later on the e2e LM and MoE (110 s against 86.8 s, 80.1 s
    against 70.4 s; docs/benchmarks.md): a held step gives up overlap, which gains most where
    the wire carries float32. ``off``: pushes go from the hooks on every step."""

    def __post_init__(self) -> None:
        if self.mode not in OVERLAP_MODES:
            raise ValueError(f"overlap mode must be one of {OVERLAP_MODES}, got {self.mode!r}")
        if not self.min_ratio >= 0:
            raise ValueError(f"min_ratio must be >= 0, got {self.min_ratio}")
        if self.hold_when_clipping not in HOLD_MODES:
            raise ValueError(f"hold_when_clipping must be one of {HOLD_MODES}, got "
                             f"{self.hold_when_clipping!r}")
        if self.probe_steps < 1:
            raise ValueError(f"probe_steps must be >= 1, got {self.probe_steps}")
        if self.bucket_bytes < 1 or self.inflight_bytes < 1:
            raise ValueError(f"bucket_bytes and inflight_bytes must be >= 1, got "
                             f"{self.bucket_bytes} and {self.inflight_bytes}")


POOL_ALLOCATORS = ("buddy", "bestfit")
POOL_POLICIES = ("lru", "schedule")


@dataclass(kw_only=True, frozen=True)
class PoolConfig:
    """The activation pool (``worker.memory.pool.ActivationPool``)."""

    capacity_bytes: int = 0
    """Arena size; 0 = ``fraction`` of the device's memory (CUDA: total memory; CPU: RAM)."""
    fraction: float = 0.3
    """Share of device memory reserved when ``capacity_bytes`` is 0 (the problem statement's
    30 %)."""
    allocator: str = field(default="bestfit", metadata={"choices": POOL_ALLOCATORS})
    """``bestfit`` (``native.bestfit``) or ``buddy`` (power-of-two blocks, ``native.buddy``).
    ``bitps-bench memory`` measured best-fit needing 0.6 % more arena than the peak of live
    activations on a dynamic-batch 1F1B trace, against +24 % for a buddy (+21 % trimmed)."""
    trim: bool = True
    """buddy: give the unused tail of each block back (allocations keep their size rounded up
    to ``min_block`` instead of to a power of two)."""
    policy: str = field(default="schedule", metadata={"choices": POOL_POLICIES})
    """What to offload to host memory under pressure: ``schedule`` (the entry needed furthest in
    the future: the latest micro-batch's backward, then the earliest layer; fetches are served
    from host memory) or ``lru`` (least recently used; a fetched entry comes back into the
    arena, as in any LRU cache). Under 1F1B, LRU evicts the oldest micro-batch, whose backward
    runs next; ``bitps-bench memory`` measures both."""
    min_block: int = 4 << 20
    """buddy: smallest block (the problem statement's 4 MB unit)."""
    max_block: int = 2 << 30
    """buddy: largest block; larger tensors bypass the pool (counted as fallbacks)."""
    align: int = 512
    """bestfit: allocation granularity in bytes."""
    min_tensor_bytes: int = 1 << 20
    """Saved tensors smaller than this stay with the framework allocator (not counted)."""

    def __post_init__(self) -> None:
        if self.allocator not in POOL_ALLOCATORS:
            raise ValueError(f"allocator must be one of {POOL_ALLOCATORS}, got "
                             f"{self.allocator!r}")
        if self.policy not in POOL_POLICIES:
            raise ValueError(f"policy must be one of {POOL_POLICIES}, got {self.policy!r}")
        if self.capacity_bytes < 0 or not 0 < self.fraction <= 1:
            raise ValueError(f"capacity_bytes must be >= 0 and fraction in (0, 1], got "
                             f"{self.capacity_bytes} and {self.fraction}")
        if self.min_tensor_bytes < 1:
            raise ValueError(f"min_tensor_bytes must be >= 1, got {self.min_tensor_bytes}")


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    """What the ``bitps-worker`` program does around the library: how long it trains, on which
    device, and what it reports (``ClientConfig``, ``OverlapConfig`` and ``PoolConfig`` are the
    library's settings; ``worker.demo.DemoConfig`` the model's)."""

    steps: int = 150
    """Training steps (every step pushes and pulls once)."""
    threads: int = 1
    """torch CPU threads (``torch.set_num_threads``)."""
    local_rank: int = 0
    """GPU index on this host (torchrun's ``LOCAL_RANK``); picks the device when ``device`` is
    ``auto``."""
    device: str = "auto"
    """torch device; ``auto`` = ``cuda:<local_rank>`` when CUDA is available, else ``cpu``."""
    metrics_port: int = 0
    """Prometheus port; 0 picks a free port (reported in the start line), -1 disables it."""
    metrics_host: str = "127.0.0.1"
    """Address the Prometheus endpoint binds to (0.0.0.0 inside containers)."""
    step_delay_s: float = 0.0
    """Extra seconds of sleep per step, after backward (simulates a straggler)."""
    profile_dir: str = ""
    """Non-empty: write a ``torch.profiler`` trace of ``profile_steps`` steps (after 2 warm-up
    steps) to ``<profile_dir>/trace-rank<R>.json`` and print the top operators."""
    profile_steps: int = 5
    """Steps the profiler records."""
    activation_pool: bool = False
    """Keep saved activations in a pre-reserved arena with host offload
    (``ActivationPool``, set up by ``PoolConfig``)."""
    log_every: int = 10
    """A progress line every this many steps (and after the last)."""
    json: bool = False
    """Progress as JSON lines on stdout (``start``, ``step``, ``done``), which ``bitps-launch``
    reads; else log lines on stderr."""

    def __post_init__(self) -> None:
        for attr in ("steps", "threads", "profile_steps", "log_every"):
            if getattr(self, attr) < 1:
                raise ValueError(f"{attr} must be >= 1, got {getattr(self, attr)}")
        if self.local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {self.local_rank}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [-1, 65535], got {self.metrics_port}")
        if not self.step_delay_s >= 0:
            raise ValueError(f"step_delay_s must be >= 0, got {self.step_delay_s}")


TRAINERS = Registry("worker algorithm")
"""Every worker algorithm by ``AlgorithmConfig.name``: a trainer factory ``(model, client,
cfg) -> trainer`` (``worker.algorithms.trainers``, where ``ps`` and ``diloco`` register, and
where a plug-in registers its own with ``register_trainer``)."""
ALGORITHMS = TRAINERS.names()
"""The ``--algorithm`` choices: a live view of :data:`TRAINERS`."""


@dataclass(kw_only=True, frozen=True)
class AlgorithmConfig:
    """How ``bitps-worker`` trains through the parameter server."""

    name: str = field(default="ps", metadata={"choices": ALGORITHMS})
    """``ps``: every step pushes the gradients and pulls the parameters (``PSModel``; the
    shards run the optimizer). ``diloco``: local SGD (``worker.algorithms.local_sgd.LocalSGD``):
    every worker runs ``inner_steps`` steps of AdamW on its own, then pushes the pseudo-gradient and
    pulls; the shards' rule is the outer optimizer (``bitps-launch --algorithm diloco`` sets
    DiLoCo's: SGD, Nesterov momentum 0.9, lr 0.7). Or a trainer a plug-in registers
    (:data:`TRAINERS`)."""
    inner_steps: int = 8
    """diloco: inner steps per round (H); one push and one pull per round."""
    inner_lr: float = 3e-3
    """diloco: learning rate of the inner AdamW."""
    inner_weight_decay: float = 0.0
    """diloco: decoupled weight decay of the inner AdamW."""
    fragments: int = 1
    """diloco: streaming, the parameters in this many fragments of consecutive tensors, each
    exchanged once per round at its own step (1: all at the end of the round)."""
    fragment_overlap_steps: int = 0
    """diloco streaming: inner steps a fragment's exchange stays in flight while training goes
    on (0: wait for it at once); below inner_steps / fragments."""
    inner_steps_adaptive: bool = False
    """diloco: dynamic local updates (DyLU, Liu et al. 2024): each round takes max(1,
    round(inner_steps * v / v_max)) steps, v this worker's measured steps/s and v_max the
    fastest live worker's (reported in heartbeats), so a slow worker pushes about as often as
    a fast one; whole rounds only (fragments 1)."""

    def __post_init__(self) -> None:
        if self.name not in ALGORITHMS:
            raise ValueError(f"algorithm {self.name!r}; expected one of {tuple(ALGORITHMS)}")
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {self.inner_steps}")
        if not 1 <= self.fragments <= self.inner_steps:
            raise ValueError(f"fragments must be in 1 .. inner_steps ({self.inner_steps}), "
                             f"got {self.fragments}")
        if not 0 <= self.fragment_overlap_steps < self.inner_steps // self.fragments:
            raise ValueError(f"fragment_overlap_steps must be in 0 .. "
                             f"{self.inner_steps // self.fragments - 1}, got "
                             f"{self.fragment_overlap_steps}")
        if self.inner_steps_adaptive and self.fragments > 1:
            raise ValueError(f"inner_steps_adaptive sizes whole rounds; got fragments "
                             f"{self.fragments} (expected 1)")
        if not self.inner_lr > 0 or self.inner_weight_decay < 0:
            raise ValueError(f"inner_lr {self.inner_lr} must be > 0 and inner_weight_decay "
                             f"{self.inner_weight_decay} >= 0")


def tls_settings() -> tuple[Setting, ...]:
    """A client's gRPC TLS files (``ClientConfig.tls_*``), shared by every program that asks
    the shards over gRPC (``connection_settings``, ``bitps-status``)."""
    return (
        from_field(ClientConfig, "tls_ca_file", metavar="FILE",
                   help="CA (PEM) of the shards' TLS certificates: gRPC over TLS (empty = "
                        "plaintext gRPC)"),
        from_field(ClientConfig, "tls_cert_file", metavar="FILE",
                   help="this side's TLS certificate (PEM), for shards that require one"),
        from_field(ClientConfig, "tls_key_file", metavar="FILE",
                   help="private key (PEM) of tls-cert-file"),
    )


def connection_settings() -> tuple[Setting, ...]:
    """The settings of how a client reaches the shards (token, CURVE, TLS, deadlines,
    reconnection), shared by every program that runs a :class:`PSClient` (``bitps-worker``,
    ``bitps-pipeline``) so that each can reach the same secured shards."""
    return (
        from_field(ClientConfig, "token", help="shared secret of the shards (empty = none)"),
        from_field(ClientConfig, "curve_server_key", metavar="FILE",
                   help="the shards' CURVE public key file (server.key from bitps-keygen): "
                        "encrypt the data plane (empty = plain ZeroMQ)"),
        from_field(ClientConfig, "curve_client_key", metavar="FILE",
                   help="this worker's CURVE .key_secret file, allowed by the shards"),
        *tls_settings(),
        from_field(ClientConfig, "deadline_s", name="deadline",
                   help="seconds any push/pull may wait"),
        from_field(ClientConfig, "reconnect_timeout_s", name="reconnect-timeout",
                   help="seconds to get a lost (restarted) shard back before giving up"),
        from_field(ClientConfig, "reconnect_backoff_s", name="reconnect-backoff",
                   help="first pause between re-registration attempts with a lost shard"),
        from_field(ClientConfig, "reconnect_backoff_max_s", name="reconnect-backoff-max",
                   help="longest pause between re-registration attempts with a lost shard"),
    )
