"""Shard configuration: keyword-only dataclasses, one docstring per field, validated on creation.

Each default is written here once, and each field with a fixed set of values lists them in its
``metadata["choices"]`` (the tuple ``__post_init__`` checks); ``ps/__main__.py`` turns the fields
into ``bitps-server``'s flags, environment variables and config-file keys through
``bitps.proto.settings``, which reads both from the fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from bitps.proto.registry import Registry
from bitps.proto.schedule import LRSchedule
from bitps.proto.wire import MAX_FRAME_BYTES

__all__ = ["COMPENSATIONS", "COMPENSATION_NAMES", "CONSISTENCY", "LR_BY", "MODES", "OPTIMIZERS",
           "OptimizerConfig", "RULES", "RuleConfig", "ServerConfig"]

RULES = Registry("update rule")
"""Every update rule by ``OptimizerConfig.name`` (``ps.rules`` and the rule plug-ins register
theirs; so may any module imported before the config is made)."""
CONSISTENCY = Registry("consistency mode")
"""Every consistency mode by ``ServerConfig.mode`` (``ps.consistency``; so may any module
imported before the config is made, such as a plug-in)."""
COMPENSATIONS = Registry("staleness compensation")
"""Every staleness compensation by ``ServerConfig.compensation`` (``ps.compensation``; so may
a plug-in)."""
OPTIMIZERS = RULES.names()
"""The ``--optimizer`` choices: a live view of :data:`RULES` (a plug-in's rule included)."""
MODES = CONSISTENCY.names()
"""The ``--mode`` choices: a live view of :data:`CONSISTENCY` (a plug-in's mode included)."""
COMPENSATION_NAMES = COMPENSATIONS.names(first=("none",))
"""The ``--compensation`` choices: a live view of :data:`COMPENSATIONS`."""
LR_BY = ("clock", "progress")
"""The ``--lr-by`` choices: where async/SSP read a push's learning rate from the schedule
(``ServerConfig.lr_by``)."""


@dataclass(kw_only=True, frozen=True)
class RuleConfig:
    """The base of an update rule's own config section: a keyword-only dataclass with a
    docstring per field, which the rule names as its ``UpdateRule.config`` (and whose settings
    it lists in ``UpdateRule.settings``, for ``bitps-server``). ``OptimizerConfig.rule_config``
    holds the running rule's section."""

    restart_free: ClassVar[tuple[str, ...]] = ()
    """Fields a checkpoint need not match: restoring makes the state fit the running value, so
    the state's layout does not depend on them (``ps.checkpoint``). A checkpoint written before
    such a field existed restores too. Any other field a checkpoint predates is read as its
    default, so a field added later must default to the behaviour from before it."""

    def check(self, server: ServerConfig) -> None:
        """Refuse (``ValueError`` naming the values) a combination with the shard's other
        settings that the rule cannot run; called by ``ServerConfig`` on creation."""


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    """The update rule the shard applies to each key (same meaning as ``torch.optim``)."""

    name: str = field(default="adam", metadata={"choices": OPTIMIZERS})
    """A registered update rule: ``sgd``, ``momentum``, ``adam``, ``adamw``, ``onebit_adam``,
    ``nesterov`` (local SGD's outer rule, ``ps.outer``) or a plug-in's (``ps.rules.register``)."""
    lr: float = 1e-3
    """Learning rate (the peak, with a schedule)."""
    schedule: LRSchedule = field(default_factory=LRSchedule)
    """Factor of ``lr`` by clock (``proto.schedule``: linear warm-up, then cosine); evaluated
    at the push's clock in async/ssp and at the step's in sync."""
    momentum: float = 0.9
    """Momentum factor (``momentum`` only)."""
    dampening: float = 0.0
    """Momentum dampening (``momentum`` only)."""
    nesterov: bool = False
    """Nesterov momentum (``momentum`` only)."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.999
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam denominator epsilon."""
    weight_decay: float = 0.0
    """L2 penalty (``sgd``/``momentum``/``adam``) or decoupled decay (``adamw`` and the rules
    built on it)."""
    delta_history: int = 16
    """Published codes kept per key (compressed pulls, and rules that publish their own): a
    worker further behind gets the full parameters instead."""
    rule_config: Any = None
    """The rule's own section: an instance of the :class:`RuleConfig` subclass the rule names
    as its ``config`` (1-bit Adam's ``ps.onebit.OneBitConfig``); ``None`` is that class's
    defaults (and stays ``None`` for a rule without a section)."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.name!r} is not one of {tuple(OPTIMIZERS)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        for attr in ("momentum", "beta1", "beta2"):
            value = getattr(self, attr)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{attr} must be in [0, 1), got {value}")
        if not 0.0 <= self.dampening <= 1.0:
            raise ValueError(f"dampening must be in [0, 1], got {self.dampening}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.delta_history < 1:
            raise ValueError(f"delta_history must be >= 1, got {self.delta_history}")
        section = getattr(RULES.lookup(self.name), "config", None)
        if section is None:
            if self.rule_config is not None:
                raise ValueError(f"optimizer {self.name} has no config section; got "
                                 f"rule_config {self.rule_config!r}")
        elif self.rule_config is None:
            object.__setattr__(self, "rule_config", section())  # frozen: set once, here
        elif type(self.rule_config) is not section:
            raise ValueError(f"optimizer {self.name} takes rule_config {section.__name__}; got "
                             f"{type(self.rule_config).__name__}")


@dataclass(kw_only=True, frozen=True)
class ServerConfig:
    """One PS shard process."""

    shard_id: int = 0
    """This shard's index, 0 .. num_shards-1."""
    num_shards: int = 1
    """Shards in the cluster; workers must cut their key plan for the same number."""
    host: str = "127.0.0.1"
    """Address to bind gRPC, data and metrics endpoints to (0.0.0.0 inside containers)."""
    grpc_port: int = 0
    """gRPC control port; 0 picks a free port (reported in the ready line)."""
    data_port: int = 0
    """ZeroMQ ROUTER data port; 0 picks a free port."""
    metrics_port: int = 0
    """Prometheus HTTP port; 0 picks a free port, -1 disables the endpoint."""
    health_port: int = -1
    """A plaintext gRPC port serving only the health service (``grpc.health.v1``, the
    statuses of the main port's): for probes that cannot speak TLS (Kubernetes' native gRPC
    probe, the image's HEALTHCHECK) when the gRPC port is TLS. 0 picks a free port; -1 (the
    default) serves none. It carries no Control call, token or data."""
    mode: str = field(default="async", metadata={"choices": MODES})
    """Consistency: ``sync`` (BSP), ``async`` (ASP), ``ssp`` (bounded staleness) or a mode a
    plug-in registers (``ps.consistency.register``)."""
    staleness: int = 2
    """SSP bound S: a worker at clock c is held until every live worker has clock >= c - S."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Server-side update rule."""
    heartbeat_timeout_s: float = 10.0
    """A worker silent (no heartbeat, no data) this long is dropped from the live set, once
    another worker is heard after it (every worker silent together: a partition, none is
    dropped; ``ps.clocks.ClockTable.expire``)."""
    pull_deadline_s: float = 60.0
    """Longest a held pull waits when the request names no deadline; then DEADLINE error."""
    token: str = ""
    """Shared secret checked on every gRPC call and data header; empty disables the check."""
    max_frame_bytes: int = MAX_FRAME_BYTES
    """Largest payload frame accepted."""
    reject_nonfinite: bool = True
    """Refuse gradients containing NaN or Inf (typed NON_FINITE error, nothing applied)."""
    split_lr: bool = True
    """Async/SSP: each push is applied with ``lr / live workers``, so one clock's pushes
    together move the parameters about as far as one sync step. Without it every push is a
    full Adam step, which is W steps per clock: on the demo model, two gradients from the same
    parameters applied one after the other at sync's best learning rate ended 20 % above sync
    at equal samples, and 1 % with the split (docs/design.md, Consistency and clocks)."""
    lookahead: bool = True
    """Async/SSP, keys pulled as float32: a pull gets ``x + (W - 1) * delta``, the parameters
    moved on by the key's last update once for each other live worker, so that a gradient is
    taken about where it will be applied instead of one update behind (the shard's own
    parameters are unchanged). Pulls that carry codes get them as they are, for the exact copy
    workers keep, and the workers predict themselves (``RegisterReply.worker_lookahead``,
    ``worker.training.prediction``). On the demo model, Adam with every gradient one update
    stale ended 15 % above sync at equal samples at its best learning rate, and within 0.2 %
    with the lookahead; 1-bit Adam in ssp went from 1.073x to 1.007x fp32 ssp with the workers'
    prediction (docs/algorithms.md, Staleness)."""
    staleness_damping: bool = False
    """Async/SSP: scale the learning rate by 1 / (1 + version gap) as well. Deprecated alias of
    ``compensation="damping"`` (kept for one release, CHANGELOG.md)."""
    compensation: str = field(default="none", metadata={"choices": COMPENSATION_NAMES})
    """Async/SSP: how a stale push is adjusted before the rule applies it (``ps.compensation``):
    ``none``; ``damping`` (learning rate / (1 + version gap)); ``gap_aware`` (learning rate /
    max(1, version gap / (pushers - 1)): only what is staler than the round asynchrony makes
    anyway); ``dc_asgd`` (DC-ASGD's delay compensation, ``g + lambda * g * g * (w_now -
    w_read)``); or a plug-in's. Sync ignores it. None is on by default: on the convergence bench
    none beat the lookahead alone (docs/algorithms.md, Staleness)."""
    dc_lambda: float = 0.04
    """``dc_asgd``: lambda_0 of the adaptive form, lambda = lambda_0 / sqrt(mean square of the
    key's gradients) elementwise (Zheng et al. 2017)."""
    lr_by: str = field(default="clock", metadata={"choices": LR_BY})
    """Async/SSP: the step a push's learning rate is read from the schedule at. ``clock``: the
    push's own step, so a slow worker's pushes get the learning rate of its earlier steps
    while a fast one's reach the schedule's end early. ``progress``: the key's updates so far
    over its live pushers, the step the job as a whole is at, so every worker's push at one
    moment gets one learning rate and the schedule ends when the job's samples do (with
    workers of unequal speed). Sync steps together: it accepts only ``clock``."""

    # -- limits: what one request may make a shard hold (typed LIMIT / BAD_CLOCK errors) ------
    max_clock_lead: int = 1024
    """Largest step a worker's clock may take in one request: a request for clock ``c`` (a
    pull's, a push_pull's ``c + 1``, a push's) from a worker the shard has at clock ``w`` is
    refused with ``BAD_CLOCK`` and changes nothing when ``c > w + max_clock_lead``. Workers
    count one clock per step, so a larger lead is a bug or an attack that would otherwise set
    the worker's clock for good (and with it the SSP bound of every other worker)."""
    max_held_pulls: int = 4096
    """Pulls of one worker this shard holds at once (sync steps, SSP waits); one more is
    refused with ``LIMIT``. A worker holds at most one step's pull messages per shard (with
    overlap: one per bucket message), far fewer than this for models under 1 GiB a shard."""
    max_pull_deadline_s: float = 600.0
    """Longest a held pull waits, whatever deadline the request asks for."""
    threads: int = 0
    """Threads that update one message's keys at once (``native.keypool.KeyPool``); 0 = one per
    core this process may run on (``os.sched_getaffinity``). The kernels release the GIL, so a
    message of several large keys is spread over them; a message of one key, or of keys
    smaller than ``native.keypool.MIN_SPLIT_BYTES`` together, runs on the data loop's thread.
    ``bitps-launch`` starts its shards with 1: a local cluster's shards share the cores with
    its workers."""
    max_plan_bytes: int = 8 << 30
    """Largest key plan a registration may give this shard, in float32 parameter bytes (the
    optimizer state adds up to twice as much again: Adam's m and v); larger is ``LIMIT``."""
    max_plan_keys: int = 1 << 16
    """Most keys a registration's plan may give this shard; more is ``LIMIT``."""
    max_message_keys: int = 1 << 16
    """Most keys one data message may name (a worker's ``message_bytes``, 256 KiB, holds at
    most 65536 float32 keys of one element); more is ``LIMIT``."""
    max_workers: int = 4096
    """Largest world size a registration may name (the shard keeps a clock per rank)."""
    max_connections: int = 1024
    """Most data-plane connections the shard serves at once (a worker opens one per thread
    that sends, usually two); a message on a new one past it is answered ``LIMIT``. A
    connection counts until it has been silent for ``heartbeat_timeout_s``."""
    dedup_window: int = 1024
    """The ids of each worker's last applied pushes the shard remembers (every mode). A push
    that repeats one of them (same worker, incarnation and request id: a replay or a resend,
    from any connection) is answered, a push with an ack and a push_pull with the parameters,
    and not applied again; 0 turns the check off. While it is on, a push or push_pull without
    an incarnation (``DataHeader.incarnation`` 0) is refused, ``BAD_HEADER``; pulls need none.
    The window is part of a checkpoint, so a push applied before it is still refused after a
    restart."""

    # -- checkpoints and lifetime (ps.checkpoint, docs/checkpoints.md) ----------------------
    checkpoint_dir: str = ""
    """This shard's checkpoint directory; empty turns checkpoints off. A shard started with
    one restores the newest valid checkpoint in it before it serves (a damaged newest one is
    logged and skipped; refused when none is valid or it is another shard's) and writes a
    final one on SIGTERM."""
    checkpoint_every_updates: int = 0
    """With ``checkpoint_dir``: write a checkpoint every this many key updates applied (0 =
    not by count). A kill loses at most this many updates (and those of a write still under
    way)."""
    checkpoint_every_s: float = 0.0
    """With ``checkpoint_dir``: write a checkpoint every this many seconds in which at least
    one update was applied (0 = not by time)."""
    checkpoint_keep: int = 3
    """With ``checkpoint_dir``: checkpoints kept on disk, newest first (>= 1)."""
    checkpoint_durable: bool = True
    """With ``checkpoint_dir``: a checkpoint that falls due is on disk before the replies of the
    request that made it due leave the shard, so a kill never loses an update a worker saw
    acknowledged beyond the last interval, and sync workers redo exactly the step that was
    lost. The data loop waits for each write (about 1 s per 64 MiB of parameters with Adam).
    False: written on a background thread while replies go at once (a kill during a write
    loses up to two intervals)."""
    exit_when_done: bool = False
    """Exit with status 0 once every rank of the registered world has registered and left
    (``Leave``), after the final checkpoint: for Kubernetes Jobs. Never before a worker has
    registered; a worker dropped for silence has not left."""

    # -- encryption and client keys (docs/security.md) ---------------------------------------
    curve_secret_key: str = ""
    """The shard's CURVE key pair, a ``.key_secret`` file (``bitps-keygen``); non-empty turns
    CURVE on for the data plane: every connection is encrypted and authenticated, and only
    clients whose public key is in ``curve_allowed_keys`` may connect (ZAP). Empty: plain
    ZeroMQ, as before. Needs ``curve_allowed_keys``."""
    curve_allowed_keys: str = ""
    """With ``curve_secret_key``: a directory of the public keys (``*.key``) of the workers
    allowed on the data plane, read at start."""
    tls_cert_file: str = ""
    """The shard's TLS certificate chain (PEM); with ``tls_key_file`` the gRPC control plane
    (and the health service on it) takes TLS only. Empty: plaintext gRPC."""
    tls_key_file: str = ""
    """The private key (PEM) of ``tls_cert_file``."""
    tls_client_ca_file: str = ""
    """With TLS: CA certificates (PEM) that client certificates must be signed by; non-empty
    requires every gRPC client to present one (mutual TLS). Empty: any client that trusts the
    shard's certificate may connect (the token still applies)."""

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: one per core), got {self.threads}")
        if not 0 <= self.shard_id < self.num_shards:
            raise ValueError(f"shard_id must be in [0, {self.num_shards}), got {self.shard_id}")
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {tuple(MODES)}")
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.compensation not in COMPENSATION_NAMES:
            raise ValueError(f"compensation {self.compensation!r} is not one of "
                             f"{tuple(COMPENSATION_NAMES)}")
        if self.staleness_damping and self.compensation not in ("none", "damping"):
            raise ValueError(f"staleness_damping is compensation 'damping'; got both it and "
                             f"compensation {self.compensation!r}")
        if self.dc_lambda < 0:
            raise ValueError(f"dc_lambda must be >= 0, got {self.dc_lambda}")
        if self.lr_by not in LR_BY:
            raise ValueError(f"lr_by {self.lr_by!r}; expected one of {LR_BY}")
        if self.lr_by != "clock" and self.mode == "sync":
            raise ValueError(f"lr_by {self.lr_by!r} applies to async/ssp; sync steps together "
                             f"(use clock)")
        for attr in ("grpc_port", "data_port"):
            port = getattr(self, attr)
            if not 0 <= port <= 65535:
                raise ValueError(f"{attr} must be in [0, 65535], got {port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [-1, 65535], got {self.metrics_port}")
        if not self.heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {self.heartbeat_timeout_s}")
        if not self.pull_deadline_s > 0:
            raise ValueError(f"pull_deadline_s must be > 0, got {self.pull_deadline_s}")
        if not 1024 <= self.max_frame_bytes <= 1 << 30:
            raise ValueError(f"max_frame_bytes must be in [1 KiB, 1 GiB], got "
                             f"{self.max_frame_bytes}")
        for attr in ("max_clock_lead", "max_held_pulls", "max_plan_bytes", "max_plan_keys",
                     "max_message_keys", "max_workers", "max_connections"):
            if getattr(self, attr) < 1:
                raise ValueError(f"{attr} must be >= 1, got {getattr(self, attr)}")
        if not self.max_pull_deadline_s > 0:
            raise ValueError(f"max_pull_deadline_s must be > 0, got {self.max_pull_deadline_s}")
        if self.dedup_window < 0:
            raise ValueError(f"dedup_window must be >= 0, got {self.dedup_window}")
        self._check_checkpoints()
        self._check_security()
        if self.optimizer.rule_config is not None:
            self.optimizer.rule_config.check(self)

    def _check_security(self) -> None:
        """Settings that only work together: given alone they would leave a plane open (or
        unreachable) while the operator believes it is protected. The files are read by
        ``ServerShard`` at start (``bitps.proto.keys``)."""
        if bool(self.curve_secret_key) != bool(self.curve_allowed_keys):
            raise ValueError(f"curve_secret_key {self.curve_secret_key!r} and "
                             f"curve_allowed_keys {self.curve_allowed_keys!r}: expected both "
                             f"(CURVE on) or neither")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError(f"tls_cert_file {self.tls_cert_file!r} and tls_key_file "
                             f"{self.tls_key_file!r}: expected both (TLS on) or neither")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError(f"tls_client_ca_file {self.tls_client_ca_file!r} given without "
                             f"tls_cert_file and tls_key_file; expected TLS on to check client "
                             f"certificates")

    def _check_checkpoints(self) -> None:
        if not self.checkpoint_every_updates >= 0 or not self.checkpoint_every_s >= 0:
            raise ValueError(f"checkpoint_every_updates and checkpoint_every_s must be >= 0 "
                             f"(0 = off), got {self.checkpoint_every_updates} and "
                             f"{self.checkpoint_every_s}")
        if self.checkpoint_keep < 1:
            raise ValueError(f"checkpoint_keep must be >= 1, got {self.checkpoint_keep}")
        if not self.checkpoint_dir:
            defaults = {f.name: f.default for f in fields(self)}
            given = [f"{name} {getattr(self, name)}" for name in (
                "checkpoint_every_updates", "checkpoint_every_s", "checkpoint_keep",
                "checkpoint_durable")
                if getattr(self, name) != defaults[name]]
            if given:
                raise ValueError(f"{', '.join(given)} given without checkpoint_dir; expected a "
                                 f"checkpoint_dir to write into (or leave them at their "
                                 f"defaults)")
