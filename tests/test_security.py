"""Encryption and client keys on both planes (issue 17, docs/security.md).

Real components: in-process shards on port 0 with real ``PSClient``s, and hand-written ZeroMQ
peers that try the data plane without the shard's key or with a key it does not allow. What
travels is checked on the wire: an ``AF_PACKET`` socket on the loopback interface (the test
runs as root; skipped otherwise) records every TCP payload to and from the shard's ports while a
worker pushes a gradient of a distinctive float32 value with a distinctive token, and the test
looks for both in the bytes, with encryption off (the control: they are there) and on.
TLS certificates are made with the ``openssl`` command (skipped without it).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import zmq
import zmq.auth
from zmq.utils import z85

from bitps.proto import bitps_pb2 as pb
from bitps.proto import bitps_pb2_grpc as pb_grpc
from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.proto.keys import (
    KeyFileError,
    keygen,
    load_allowed_keys,
    load_key_pair,
    load_public_key,
)
from bitps.proto.keys import (
    main as keygen_main,
)
from bitps.proto.wire import PROTOCOL, PSError
from bitps.ps import OptimizerConfig, ServerConfig
from bitps.ps.server import ServerShard
from bitps.worker import ClientConfig, PSClient

ROOT = Path(__file__).resolve().parents[1]
SGD = OptimizerConfig(name="sgd", lr=0.5)
TOKEN = "tok-9f3c1e7a-bitps-SECRET"
PATTERN = np.float32(1234.5678)  # 0x449A522B: not a value a test would push by chance
N = 4096
INCARNATION = 0x5EC0B  # the hand-written peer's life id: a push needs one (exactly-once window)


@pytest.fixture
def keys(tmp_path):
    """Two worker pairs allowed by one shard key (``w0``, ``w1``), and a stranger: a pair
    made with another shard key, not in the allowed directory."""
    k = keygen(tmp_path / "keys", "w0")
    w1 = keygen(tmp_path / "keys", "w1")
    other = keygen(tmp_path / "other", "stranger")
    return {**k, "w1": w1["client_secret"], "stranger": other["client_secret"],
            "other_server": other["server_key"]}


def _curve(keys) -> dict:
    return dict(curve_secret_key=str(keys["server_secret"]),
                curve_allowed_keys=str(keys["allowed"].parent))


def _client_curve(keys, name: str = "client_secret", server: str = "server_key") -> dict:
    return dict(curve_server_key=str(keys[server]), curve_client_key=str(keys[name]))


def _plan():
    plan = make_plan([ParamSpec("w", (N,))], num_shards=1, partition_bytes=4 * N)
    return plan, [k.key for k in plan.keys]


def _client(shard, **cfg) -> PSClient:
    cfg = {"token": TOKEN, "deadline_s": 5.0, **cfg}
    return PSClient(ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",), **cfg))


def _joined(shard, **cfg) -> tuple[PSClient, list[int]]:
    plan, keys = _plan()
    client = _client(shard, **cfg)
    client.register(plan, {keys[0]: np.zeros(N, np.float32)})
    return client, keys


class Peer:
    """A hand-written data-plane DEALER, optionally a CURVE client with the given keys."""

    def __init__(self, port: int, *, server: bytes | None = None,
                 pair: tuple[bytes, bytes] | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if server is not None:
            public, secret = pair or zmq.curve_keypair()
            self.sock.curve_serverkey, self.sock.curve_publickey = server, public
            self.sock.curve_secretkey = secret
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def push(self, keys, *, token: str = TOKEN, timeout_ms: int = 1000) -> pb.DataHeader | None:
        """Push ``PATTERN`` for clock 0; the reply's header, or ``None``: no answer."""
        header = pb.DataHeader(op=pb.PUSH, protocol=PROTOCOL, dtype=pb.FLOAT32, worker=0,
                               request_id=7, clock=0, keys=keys, token=token,
                               incarnation=INCARNATION)
        try:
            # a refused handshake leaves no pipe: a blocking send would wait for good
            self.sock.send_multipart([header.SerializeToString(),
                                      np.full(N, PATTERN, np.float32).tobytes()], zmq.NOBLOCK)
        except zmq.Again:
            return None
        if not self.sock.poll(timeout_ms):
            return None
        reply = pb.DataHeader()
        reply.ParseFromString(self.sock.recv_multipart()[0])
        return reply

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _pull(client, keys, clock: int = 0) -> np.ndarray:
    out = np.empty(N, np.float32)
    client.pull(keys, [out], clock=clock).wait()
    return out


# -- keys and their files --------------------------------------------------------------------------
def test_keygen_writes_zmq_certificates_secret_files_0600_never_overwritten(tmp_path, capsys):
    assert keygen_main([str(tmp_path), "--name", "w0"]) == 0
    assert "--curve-secret-key" in capsys.readouterr().out
    server_public, server_secret = zmq.auth.load_certificate(tmp_path / "server.key_secret")
    assert zmq.auth.load_certificate(tmp_path / "server.key") == (server_public, None)
    assert load_key_pair(tmp_path / "server.key_secret") == (server_public, server_secret)
    public, secret = load_key_pair(tmp_path / "w0.key_secret")
    assert zmq.curve_public(secret) == public == load_public_key(tmp_path / "w0.key")
    assert load_allowed_keys(tmp_path / "allowed") == {public}
    for name in ("server.key_secret", "w0.key_secret"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE((tmp_path / "w0.key").stat().st_mode) == 0o644
    # a second client joins the same shard key; a name is never written twice
    assert keygen_main([str(tmp_path), "--name", "w1"]) == 0
    assert zmq.auth.load_certificate(tmp_path / "server.key")[0] == server_public
    assert len(load_allowed_keys(tmp_path / "allowed")) == 2
    assert keygen_main([str(tmp_path), "--name", "w1"]) == 1
    assert "exists" in capsys.readouterr().err
    with pytest.raises(ValueError, match="file stem"):
        keygen(tmp_path, "../evil")
    installed = Path(sys.executable).parent / "bitps-keygen"
    if installed.exists():  # the console script of setup.cfg
        out = subprocess.run([str(installed), str(tmp_path / "cli")], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0 and (tmp_path / "cli" / "client.key_secret").exists()


def _bad(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_bad_key_files_are_refused_naming_the_file_and_what_was_expected(tmp_path, keys):
    good = keys["client_key"].read_text()
    short = _bad(tmp_path, "short.key", good.replace(good.split('"')[1], "abc"))
    not_z85 = _bad(tmp_path, "bad.key", good.replace(good.split('"')[1][:5], "\\\\~~~"))
    empty = _bad(tmp_path, "empty.key", "metadata\ncurve\n")
    cases = [
        (load_public_key, tmp_path / "missing.key", "cannot be read"),
        (load_public_key, short, "3 characters, not 40 of Z85"),
        (load_public_key, not_z85, "not 40 of Z85"),
        (load_public_key, empty, "no public-key"),
        (load_public_key, keys["client_secret"], "holds a secret-key"),
        (load_key_pair, keys["client_key"], "holds only a public-key"),
    ]
    for load, path, problem in cases:
        with pytest.raises(KeyFileError) as err:
            load(path)
        assert err.value.path == str(path) and problem in str(err.value), str(err.value)
        assert "expected a CURVE" in str(err.value)
    mixed = _bad(tmp_path, "mixed.key_secret", keys["client_secret"].read_text().replace(
        keys["client_secret"].read_text().split('"')[1],
        keys["server_key"].read_text().split('"')[1]))
    with pytest.raises(KeyFileError, match="does not belong"):
        load_key_pair(mixed)
    (tmp_path / "none").mkdir()
    with pytest.raises(KeyFileError, match="holds no"):
        load_allowed_keys(tmp_path / "none")
    with pytest.raises(KeyFileError, match="secret key file in the allowed"):
        load_allowed_keys(keys["client_secret"].parent)  # keygen's DIR, not DIR/allowed
    # At start: the shard binds nothing, the worker connects to nothing.
    with pytest.raises(KeyFileError, match="short.key"):
        ServerShard(ServerConfig(curve_secret_key=str(short),
                                 curve_allowed_keys=str(keys["allowed"].parent)))
    with pytest.raises(KeyFileError, match="w0.key_secret: holds a secret"):
        PSClient(ClientConfig(servers=("127.0.0.1:1",),
                              **_client_curve(keys, server="client_secret")))
    # One half of a pair is a configuration error.
    with pytest.raises(ValueError, match="curve_allowed_keys '': expected both"):
        ServerConfig(curve_secret_key="x")
    with pytest.raises(ValueError, match="expected both"):
        ClientConfig(servers=("h:1",), curve_server_key="x")
    with pytest.raises(ValueError, match="tls_key_file '': expected both"):
        ServerConfig(tls_cert_file="x")
    with pytest.raises(ValueError, match="without tls_cert_file"):
        ServerConfig(tls_client_ca_file="x")
    with pytest.raises(ValueError, match="without tls_ca_file"):
        ClientConfig(servers=("h:1",), tls_cert_file="c", tls_key_file="k")
    # bitps-server refuses to start with status 2 and says which file
    out = subprocess.run([sys.executable, "-m", "bitps.ps", "--metrics-port", "-1",
                          "--curve-secret-key", str(keys["client_key"]),
                          "--curve-allowed-keys", str(keys["allowed"].parent)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "w0.key: holds only a public-key" in out.stderr, out


# -- CURVE: who may exchange data --------------------------------------------------------------
def test_curve_lets_allowed_workers_train_and_nobody_else_exchange_data(cluster, keys):
    (shard,) = cluster(1, mode="async", optimizer=SGD, lookahead=False, token=TOKEN,
                       metrics_port=-1, **_curve(keys))
    client, keys_ = _joined(shard, **_client_curve(keys))
    grad = np.ones(N, np.float32)
    outs = [np.empty(N, np.float32)]
    for clock in range(3):
        client.push_pull(keys_, [grad], outs, clock=clock).wait()
    np.testing.assert_array_equal(outs[0], np.full(N, -1.5, np.float32))  # 3 SGD steps
    before = shard.core.updates_applied
    public = load_public_key(keys["server_key"])
    stranger = load_key_pair(keys["stranger"])
    peers = {"no CURVE at all": Peer(shard.data.port),
             "a key not allowed": Peer(shard.data.port, server=public, pair=stranger),
             "a fresh key pair": Peer(shard.data.port, server=public),
             "another shard's key": Peer(shard.data.port,
                                         server=load_public_key(keys["other_server"]),
                                         pair=load_key_pair(keys["client_secret"]))}
    for what, peer in peers.items():
        assert peer.push(keys_, timeout_ms=700) is None, what  # not a byte of an answer
        peer.close()
    assert shard.core.updates_applied == before
    np.testing.assert_array_equal(_pull(client, keys_, 3), outs[0])  # parameters unchanged
    refused = shard.data.zap.refused
    assert refused.get(z85.decode(stranger[0]), 0) >= 1, refused
    assert sum(refused.values()) >= 2  # the stranger and the fresh pair; NULL never gets a say
    # Another allowed key with a wrong token: let in, and still refused.
    allowed = Peer(shard.data.port, server=public, pair=load_key_pair(keys["w1"]))
    reply = allowed.push(keys_, token="wrong", timeout_ms=5000)
    assert reply is not None and reply.error == pb.UNAUTHENTICATED, reply
    allowed.close()
    assert shard.core.updates_applied == before
    with grpc.insecure_channel(f"127.0.0.1:{shard.ports['grpc_port']}") as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.ControlStub(ch).Status(pb.StatusRequest(token="wrong"), timeout=5,
                                           metadata=(("bitps-token", "wrong"),))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    client.close()


def test_curve_on_one_side_only_is_a_typed_error_at_registration(cluster, keys):
    (curve,) = cluster(1, mode="async", optimizer=SGD, token=TOKEN, metrics_port=-1,
                       **_curve(keys))
    (plain,) = cluster(1, mode="async", optimizer=SGD, token=TOKEN, metrics_port=-1)
    cases = [
        (curve, {}, "data plane is CURVE; expected the worker to have curve_server_key"),
        (curve, _client_curve(keys, "stranger"), "is not in shard 0's curve_allowed_keys"),
        (curve, _client_curve(keys, server="other_server"), "CURVE public key is"),
        (plain, _client_curve(keys), "serves plain ZeroMQ"),
    ]
    for i, (shard, cfg, words) in enumerate(cases):
        t0 = time.monotonic()
        with pytest.raises(PSError) as err:
            _joined(shard, **cfg)
        assert err.value.code == pb.UNAUTHENTICATED and words in err.value.message, err.value
        assert time.monotonic() - t0 < 5  # an answer, not a hang
        if i == 1:  # the shard refused these two before reading the plan
            assert not curve.core.slots and not curve.core.clocks.workers
        if i >= 2:  # the shard took the registration; the worker refused it and left at once
            with shard.core.lock:  # (issue 29: before, peers waited for its heartbeat timeout)
                workers = dict(shard.core.clocks.workers)
            assert workers and all(w.left for w in workers.values()), workers


# -- what travels on the wire --------------------------------------------------------------------
class LoopbackCapture:
    """Every TCP payload on ``lo`` to or from ``ports``, by direction ``(src, dst)`` port
    pair, in arrival order; each packet once (the outgoing copy is skipped)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.05)
        self.packets: list[tuple[int, int, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame, addr = self.sock.recvfrom(1 << 17)
            except TimeoutError:
                continue
            if addr[2] == socket.PACKET_OUTGOING or frame[12:14] != b"\x08\x00":
                continue
            ip = frame[14:]
            if ip[9] != 6:  # TCP
                continue
            tcp = ip[(ip[0] & 0x0F) * 4:struct.unpack("!H", ip[2:4])[0]]
            src, dst = struct.unpack("!HH", tcp[:4])
            payload = tcp[(tcp[12] >> 4) * 4:]
            if payload:
                self.packets.append((src, dst, bytes(payload)))

    def stop(self) -> None:
        time.sleep(0.2)  # the last packets
        self._stop.set()
        self._thread.join()
        self.sock.close()

    def bytes_of(self, port: int) -> bytes:
        """Both directions of every connection to ``port``, each direction's stream joined
        (so a token cut across segments is found), one stream after another."""
        flows: dict[tuple[int, int], bytearray] = {}
        for src, dst, payload in self.packets:
            if port in (src, dst):
                flows.setdefault((src, dst), bytearray()).extend(payload)
        return b"\0".join(bytes(f) for f in flows.values())


def _capture_ok() -> bool:
    try:
        socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003)).close()
        return True
    except (OSError, AttributeError):
        return False


needs_capture = pytest.mark.skipif(not _capture_ok(), reason="needs an AF_PACKET socket "
                                   "(root or CAP_NET_RAW on Linux)")
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture
def certs(tmp_path):
    """A CA, a shard certificate for 127.0.0.1/localhost and a worker certificate (P-256)."""
    d = tmp_path / "tls"
    d.mkdir()
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=bitps-test-ca", cwd=d)
    for name, san in (("shard", "IP:127.0.0.1,DNS:localhost"), ("worker", "DNS:worker")):
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
                 f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile",
                 f"{name}.ext", cwd=d)
    return {name: str(d / name) for name in ("ca.pem", "shard.pem", "shard.key", "worker.pem",
                                             "worker.key")}


def _exchange(cluster, server: dict, client: dict) -> tuple[LoopbackCapture, object]:
    """Register, push ``PATTERN`` and pull once, all under capture."""
    cap = LoopbackCapture()
    try:
        (shard,) = cluster(1, mode="async", optimizer=SGD, lookahead=False, token=TOKEN,
                           metrics_port=-1, **server)
        c, keys_ = _joined(shard, **client)
        c.push(keys_, [np.full(N, PATTERN, np.float32)], clock=0).wait()
        assert c.status(0).updates_applied == 1
        np.testing.assert_array_equal(_pull(c, keys_, 1), np.full(N, -0.5 * PATTERN,
                                                                  np.float32))
        c.close()
    finally:
        cap.stop()
    return cap, shard


def _seen(data: bytes) -> dict[str, bool]:
    pattern = np.full(8, PATTERN, np.float32).tobytes()  # 32 bytes of the gradient
    return {"token": TOKEN.encode() in data, "gradient": pattern in data}


@needs_capture
def test_with_curve_neither_token_nor_gradient_is_on_the_data_plane_wire(cluster, keys):
    plain, shard = _exchange(cluster, {}, {})
    data = plain.bytes_of(shard.data.port)
    assert len(data) > 4 * N and _seen(data) == {"token": True, "gradient": True}  # control
    enc, shard = _exchange(cluster, _curve(keys), _client_curve(keys))
    data = enc.bytes_of(shard.data.port)
    assert len(data) > 4 * N, len(data)  # the push went this way, encrypted
    assert _seen(data) == {"token": False, "gradient": False}
    # gRPC is still plaintext without TLS: the token shows there (the next test covers TLS)
    assert _seen(enc.bytes_of(shard.ports["grpc_port"]))["token"]


@needs_capture
@needs_openssl
def test_with_tls_and_curve_nothing_secret_is_on_either_plane(cluster, keys, certs):
    plain, shard = _exchange(cluster, {}, {})
    assert _seen(plain.bytes_of(shard.ports["grpc_port"]))["token"]  # control
    server = dict(_curve(keys), tls_cert_file=certs["shard.pem"],
                  tls_key_file=certs["shard.key"], tls_client_ca_file=certs["ca.pem"])
    client = dict(_client_curve(keys), tls_ca_file=certs["ca.pem"],
                  tls_cert_file=certs["worker.pem"], tls_key_file=certs["worker.key"])
    enc, shard = _exchange(cluster, server, client)
    for port in (shard.ports["grpc_port"], shard.data.port):
        data = enc.bytes_of(port)
        assert len(data) > 1000 and _seen(data) == {"token": False, "gradient": False}, port


# -- TLS: who may call ---------------------------------------------------------------------------
@needs_openssl
def test_tls_refuses_plaintext_and_certificate_less_clients_with_an_error(cluster, certs):
    (tls,) = cluster(1, mode="async", optimizer=SGD, token=TOKEN, metrics_port=-1,
                     tls_cert_file=certs["shard.pem"], tls_key_file=certs["shard.key"])
    (mtls,) = cluster(1, mode="async", optimizer=SGD, token=TOKEN, metrics_port=-1,
                      tls_cert_file=certs["shard.pem"], tls_key_file=certs["shard.key"],
                      tls_client_ca_file=certs["ca.pem"])
    (plain,) = cluster(1, mode="async", optimizer=SGD, token=TOKEN, metrics_port=-1)
    ca = {"tls_ca_file": certs["ca.pem"]}
    mine = {**ca, "tls_cert_file": certs["worker.pem"], "tls_key_file": certs["worker.key"]}
    for shard, cfg in ((tls, {}), (mtls, ca), (plain, ca), (mtls, {})):
        t0 = time.monotonic()
        with pytest.raises(PSError) as err:
            _joined(shard, register_timeout_s=10, **cfg)
        assert "UNAVAILABLE" in err.value.message, err.value
        assert time.monotonic() - t0 < 8, "a refused handshake must fail, not hang"
    for shard, cfg in ((tls, ca), (mtls, mine)):
        client, keys_ = _joined(shard, **cfg)
        assert client.status(0).initialized
        # a wrong token over TLS is refused as before
        stub = client.control.stubs[0]
        with pytest.raises(grpc.RpcError) as err:
            stub.Status(pb.StatusRequest(token="wrong"), timeout=5,
                        metadata=(("bitps-token", "wrong"),))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        client.close()
    with pytest.raises(KeyFileError, match="ca.srl: is .* bytes without a PEM block"):
        PSClient(ClientConfig(servers=("127.0.0.1:1",), tls_ca_file=str(
            Path(certs["ca.pem"]).with_suffix(".srl"))))


# -- the hang doctor's hook ----------------------------------------------------------------------
def test_a_slow_wait_logs_the_shard_and_whom_it_waits_for(cluster, caplog):
    from bitps.worker.__main__ import log_slow_waits

    (shard,) = cluster(1, mode="sync", optimizer=SGD, token=TOKEN, metrics_port=-1)
    plan, keys_ = _plan()
    rank0 = _client(shard, rank=0, world_size=2, deadline_s=1.6)
    rank0.register(plan, {keys_[0]: np.zeros(N, np.float32)})
    rank1 = _client(shard, rank=1, world_size=2)
    rank1.register(plan)
    log_slow_waits(rank0)
    seen: list[tuple[int, float]] = []
    slow = rank0.on_slow_wait
    rank0.on_slow_wait = lambda s, w: (seen.append((s, w)), slow(s, w))
    out = np.empty(N, np.float32)
    handle = rank0.push_pull(keys_, [np.ones(N, np.float32)], [out], clock=0)
    with caplog.at_level(logging.WARNING):
        with pytest.raises(PSError):
            handle.wait()  # held: rank 1 has not pushed step 0
    assert len(seen) == 1 and seen[0][0] == 0 and 0.8 <= seen[0][1] < 1.6, seen
    lines = [r.getMessage() for r in caplog.records if "no answer from shard 0" in
             r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert "holds rank 0's pull for clock 1" in lines[0] and "waiting for rank 1" in lines[0]
    # A diagnosis that fails is logged and does not change the wait's outcome.
    rank0.on_slow_wait = lambda s, w: 1 / 0
    with caplog.at_level(logging.ERROR), pytest.raises(PSError):
        rank0.pull(keys_, [out], clock=1).wait(timeout=0.4)
    assert any("on_slow_wait" in r.getMessage() for r in caplog.records)
    rank1.close()
    rank0.close(leave=False)


def test_without_keys_nothing_changes(cluster):
    (shard,) = cluster(1, mode="async", optimizer=SGD, metrics_port=-1)
    assert shard.curve is None and shard.data.zap is None
    assert shard.data.context is zmq.Context.instance()  # shared, as before
    client, keys_ = _joined(shard, token="")
    assert client.control.curve is None and client.control.metadata is None
    client.push(keys_, [np.ones(N, np.float32)], clock=0).wait()
    client.close()
    assert os.environ.get("BITPS_CURVE_SECRET_KEY") is None


def test_sighup_reloads_the_allowed_client_keys(tmp_path, keys):
    """Issue 29: a shard read its allowed client keys only at start, so adding a worker meant
    a restart. SIGHUP to ``bitps-server`` reads the directory again: a key added since is let
    in, a key removed is refused from its next connection on."""
    from bitps.bench.faults import start_server

    shard = start_server("--mode", "async", "--optimizer", "sgd",
                         *(f"--{k.replace('_', '-')}={v}" for k, v in _curve(keys).items()))
    port = {"ports": {"grpc_port": shard.ready["grpc_port"]}}
    target = type("Shard", (), port)
    try:
        late = keygen(tmp_path / "keys", "late")  # written after the shard started
        with pytest.raises(PSError) as err:
            _joined(target, token="", **_client_curve({**keys, "late": late["client_secret"]},
                                                      "late"))
        assert "is not in shard 0's curve_allowed_keys" in err.value.message
        keys["allowed"].unlink()  # w0 is revoked: allowed/w0.key goes
        shard.popen.send_signal(signal.SIGHUP)
        end = time.monotonic() + 10
        while True:
            try:
                client, _ = _joined(target, token="", **_client_curve(
                    {**keys, "late": late["client_secret"]}, "late"))
                break
            except PSError:
                assert time.monotonic() < end, "the new key was never let in"
                time.sleep(0.2)
        client.close()
        with pytest.raises(PSError) as err:
            _joined(target, token="", **_client_curve(keys))  # w0: removed
        assert "is not in shard 0's curve_allowed_keys" in err.value.message
        assert shard.alive()
    finally:
        shard.kill()


def test_a_tls_shard_is_checked_by_bitps_status_and_probed_on_its_health_port(cluster, certs):
    """Issue 29: nothing could check a TLS shard's health. ``--health-port`` serves the
    health service alone in plaintext (Kubernetes' native gRPC probe, the image's
    HEALTHCHECK), with the main port's statuses; ``bitps-status`` speaks TLS with the
    worker's ``--tls-*`` files."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from bitps.worker.launch import status

    (shard,) = cluster(1, mode="async", optimizer=SGD, token=TOKEN, metrics_port=-1,
                       health_port=0, tls_cert_file=certs["shard.pem"],
                       tls_key_file=certs["shard.key"])
    port = shard.ports["health_port"]
    assert port > 0 and port != shard.ports["grpc_port"]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="bitps.Control"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError):  # health only: no Control call on this port
            pb_grpc.ControlStub(ch).Status(pb.StatusRequest(token=TOKEN), timeout=5)
    server = f"127.0.0.1:{shard.ports['grpc_port']}"
    base = ["--servers", server, "--token", TOKEN, "--json", "--timeout", "3"]
    assert status.main(base) == 1  # plaintext against TLS: not answered
    assert status.main([*base, "--tls-ca-file", certs["ca.pem"]]) == 0
    assert status.main([*base, "--tls-ca-file", str(certs["shard.key"]) + ".missing"]) == 2
    shard.stop(0)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, pytest.raises(grpc.RpcError):
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
