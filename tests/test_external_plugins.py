"""Plug-ins from outside the package (issue 25): a codec, an update rule with state, a
consistency mode and a worker algorithm, each one file in ``tests/plugins_outside/``, loaded with
``--plugin FILE``, ``BITPS_PLUGINS``, a config file's ``plugins`` key or a module name on
``PYTHONPATH``, and selected by flag or config file (docs/plugins.md).

In this process the plug-ins are loaded only inside :func:`isolated`, which forgets them
afterwards, so that later tests (the generated reference, the checks that the core names no
algorithm) see bitps's own registrations alone; the multi-process test loads them into real
``bitps-server`` and ``bitps-worker`` processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bitps.bench.faults import ROOT, ServerProcess, start_server
from bitps.proto import bitps_pb2 as pb
from bitps.proto import bitps_pb2_grpc as pb_grpc
from bitps.proto.plugins import PluginError, load_plugins
from bitps.proto.settings import SettingError
from bitps.proto.wire import PROTOCOL
from tests.helpers import one_key_core

PLUGINS = ROOT / "tests" / "plugins_outside"
CODEC, RULE, MODE, TRAINER = (str(PLUGINS / f) for f in (
    "int8key_codec.py", "counted_rule.py", "half_async_mode.py", "accumulate_trainer.py"))
N = 1000
INCARNATION = 0x3F  # the pushes' life id (a push needs one: the exactly-once window)


@pytest.fixture
def isolated():
    """Plug-ins loaded in this test are forgotten afterwards: every registry, the loader's
    cache and the plug-in modules are as before."""
    from bitps.proto import codecs, plugins
    from bitps.ps.config import CONSISTENCY, RULES
    from bitps.worker.config import TRAINERS

    tables = (RULES, CONSISTENCY, TRAINERS, codecs.CODECS, codecs._KINDS, codecs._BY_NAME,
              plugins._BY_PATH)
    saved = [dict(t) for t in tables]
    yield
    for table, copy in zip(tables, saved):
        table.clear()  # in place: the live choices (registry views) see the same objects
        table.update(copy)
    for name in [m for m in sys.modules if m.startswith("bitps_plugin_")]:
        del sys.modules[name]


# -- in one process: loading, choices, refusals -------------------------------------------------
def test_plugins_named_anywhere_are_loaded_first_and_their_names_become_choices(
        isolated, tmp_path, capsys):
    from bitps.ps import __main__ as server_cli
    from bitps.worker import __main__ as worker_cli

    with pytest.raises(SystemExit) as exit:  # not loaded yet: not a choice
        server_cli.parse_config(["--mode", "half_async"], environ={})
    assert exit.value.code == 2
    assert ("argument --mode: got 'half_async'; expected one of sync, async, ssp (a plug-in's "
            "name is one once --plugin loads it)") in capsys.readouterr().err

    # a config file's key
    toml = tmp_path / "shard.toml"
    toml.write_text(f'plugins = ["{MODE}"]\nmode = "half_async"\n')
    cfg, args = server_cli.parse_config(["--config", str(toml)], environ={})
    assert cfg.mode == "half_async" and args.plugin == [MODE]
    # flags, repeated and comma-separated, win over the environment; the rule's own flag
    # exists once the rule is loaded
    cfg, args = server_cli.parse_config(
        ["--plugin", CODEC, f"--plugin={RULE},{MODE}", "--optimizer", "counted_sgd",
         "--counted-decay", "0.25", "--mode", "half_async"],
        environ={"BITPS_PLUGINS": "not_loaded_when_flags_name_plugins"})
    assert (cfg.optimizer.name, cfg.optimizer.rule_config.decay) == ("counted_sgd", 0.25)
    assert args.plugin == [CODEC, RULE, MODE]
    helps = server_cli.program().parser().format_help()
    assert "half_async" in helps and "counted_sgd" in helps and "--counted-decay" in helps
    # the environment
    wcfg, _ = worker_cli.parse_config(
        ["--servers", "h:1", "--algorithm", "accumulate", "--push-codec", "int8key",
         "--pull-codec", "raw"], environ={"BITPS_PLUGINS": f" {CODEC} , {TRAINER} "})
    assert wcfg.algorithm.name == "accumulate" and wcfg.encoder.push_codec.name == "int8key"
    # the reference lists bitps's own names whatever is loaded
    page = server_cli.PROGRAM.markdown()
    assert "half_async" not in page and "counted-decay" not in page and "`ssp`" in page


@pytest.mark.parametrize("plugin, expected", [
    ("no_such_bitps_plugin", "plug-in module 'no_such_bitps_plugin' could not be loaded: "
                             "ModuleNotFoundError"),
    ("{tmp}/boom.py", "boom.py' could not be loaded: RuntimeError: boom at import"),
    ("{tmp}/taken.py", "codec 'raw' (id 0) is already registered"),
    ("{tmp}/missing.py", "no such file"),
])
def test_a_plugin_that_cannot_be_loaded_stops_the_program_with_status_2(
        isolated, tmp_path, capsys, plugin, expected):
    from bitps.ps import __main__ as server_cli

    (tmp_path / "boom.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "taken.py").write_text(
        "from bitps.proto.codecs import RawKind, register\n"
        "register(type('Again', (RawKind,), {}))\n")
    plugin = plugin.format(tmp=tmp_path)
    assert server_cli.main(["--plugin", plugin]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bitps-server: --plugin: plug-in ") and expected in err, err
    with pytest.raises(PluginError) as refused:
        server_cli.parse_config([], environ={"BITPS_PLUGINS": plugin})
    assert str(refused.value).startswith("environment variable BITPS_PLUGINS: plug-in ")
    assert expected in str(refused.value)
    bad = tmp_path / "bad.toml"
    bad.write_text("plugins = 3\n")
    with pytest.raises(SettingError, match=r"key 'plugins': got 3 \(integer\); expected a "
                                           r"string or an array of strings"):
        server_cli.parse_config(["--config", str(bad)], environ={})


# -- in one process: the rule and the mode on a shard core, and a checkpoint ------------------
def _core(cfg):
    return one_key_core(cfg, N)


def _push(core, payload: bytes, codec, clock: int) -> None:
    header = pb.DataHeader(op=pb.PUSH, protocol=PROTOCOL, worker=0, clock=clock, keys=[0],
                           dtype=pb.FLOAT32, request_id=clock + 1, incarnation=INCARNATION)
    header.codec, header.codec_chunk, header.codec_flags = codec.wire_fields()
    replies = core.handle(b"w0", [header.SerializeToString(), payload])
    assert replies[-1].header.op == pb.REPLY, replies[-1].header.message


def test_the_rule_and_mode_update_as_written_and_the_rule_state_survives_a_checkpoint(
        isolated, tmp_path):
    from bitps.proto.codecs import Codec, CodecConfig, Compressor
    from bitps.ps.checkpoint import CheckpointError, load, restore, save
    from bitps.ps.config import OptimizerConfig, ServerConfig

    rule_module, _, _ = load_plugins([RULE, MODE, CODEC])
    cfg = ServerConfig(mode="half_async", optimizer=OptimizerConfig(
        name="counted_sgd", lr=0.1, rule_config=rule_module.CountedConfig(decay=0.5)))
    core = _core(cfg)
    codec = Codec.from_config(CodecConfig(name="int8key"))
    comp = Compressor(codec, N)
    rng = np.random.default_rng(0)
    param, velocity, abs_sum = core.slots[0].param.copy(), np.zeros(N, np.float32), 0.0
    lr = np.float32(0.1 * 0.5)  # the mode halves the learning rate of the rule
    for clock in range(3):
        payload = bytes(comp.encode(rng.standard_normal(N).astype(np.float32)))
        grad = codec.decode(payload, N, np.empty(N, np.float32))  # what the shard applies
        _push(core, payload, codec, clock)
        velocity = velocity * np.float32(0.5) + grad
        param -= lr * velocity
        abs_sum += float(np.abs(grad).mean())
        assert len(payload) == N + 4
    st = core.slots[0].rule_state
    np.testing.assert_array_equal(core.slots[0].param, param)
    np.testing.assert_array_equal(st.velocity, velocity)
    assert (st.step, st.last_lr_scale) == (3, 0.5) and st.grad_abs_sum == pytest.approx(abs_sum)

    ckpt = load(save(core, tmp_path / "ckpt", keep=1))
    assert ckpt.manifest["keys"]["0"]["rule"] == {
        "step": 3, "stats/version": 1, "stats/grad_abs_sum": st.grad_abs_sum,
        "stats/last_lr_scale": 0.5}
    assert {k for k in ckpt.state if "/rule/" in k} == {"0/rule/velocity"}
    fresh = _core(cfg)
    restore(fresh, ckpt)
    back = fresh.slots[0].rule_state.state_dict()
    want = st.state_dict()
    np.testing.assert_array_equal(back.pop("velocity"), want.pop("velocity"))
    assert back == want
    # both continue alike
    payload = bytes(comp.encode(rng.standard_normal(N).astype(np.float32)))
    for c in (core, fresh):
        _push(c, payload, codec, 3)
    np.testing.assert_array_equal(fresh.slots[0].param, core.slots[0].param)
    # a shard whose rule section differs refuses the checkpoint
    other = _core(ServerConfig(mode="half_async", optimizer=OptimizerConfig(
        name="counted_sgd", lr=0.1, rule_config=rule_module.CountedConfig(decay=0.25))))
    with pytest.raises(CheckpointError, match="was saved with optimizer"):
        restore(other, ckpt)


def test_a_state_dict_splits_into_arrays_and_json_values_and_back():
    """How a checkpoint keeps any rule's state (``proto.state``): arrays for the tensor file,
    the rest as JSON for the manifest, nested dicts by joined names."""
    from bitps.proto.state import join_state, split_state

    state = {"step": np.int64(4), "m": np.arange(3, dtype=np.float32), "flags": (True, None),
             "inner": {"version": 2, "v": np.ones(2), "empty": {}}}
    arrays, values = split_state(state)
    assert set(arrays) == {"m", "inner/v"}
    assert values == {"step": 4, "flags": [True, None], "inner/version": 2, "inner/empty": {}}
    json.dumps(values)  # JSON as it is
    back = join_state(arrays, json.loads(json.dumps(values)))
    assert back["inner"]["empty"] == {} and back["inner"]["v"] is arrays["inner/v"]
    assert back["step"] == 4 and type(back["step"]) is int and back["flags"] == [True, None]
    with pytest.raises(ValueError, match="state entry 'inner/blob' is a bytes; expected"):
        split_state({"inner": {"blob": b"x"}})
    with pytest.raises(ValueError, match="state entry 'a/b': names must be"):
        split_state({"a/b": 1})


# -- real processes ----------------------------------------------------------------------------
def _metrics(port: int) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, s.labels.get("codec", "")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _rule_state(server: ServerProcess) -> dict[int, tuple[dict, np.ndarray]]:
    with grpc.insecure_channel(server.grpc_address) as ch:
        states = list(pb_grpc.ControlStub(ch).RuleState(pb.RuleStateRequest(rank=0), timeout=10))
    return {s.key: (dict(s.fields), np.frombuffer(s.arrays[0].data, np.float32))
            for s in states}


def test_plugins_train_in_real_processes_and_the_rule_state_survives_a_restart(
        tmp_path, monkeypatch):
    """A shard with the rule (by module name on PYTHONPATH), the mode and the codec (by path);
    a worker with the codec and the algorithm (BITPS_PLUGINS), the algorithm picked by its
    config file, the codec by flag. The loss drops, every push and pull is int8key, the worker
    pushes once per two steps, the rule saw every update at half the learning rate; after
    SIGTERM and a restart from the checkpoint the rule's state is the same."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    steps, every = 16, 2
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(PLUGINS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    shard_flags = ("--plugin", "counted_rule", "--plugin", f"{MODE},{CODEC}",
                   "--optimizer", "counted_sgd", "--counted-decay", "0.5", "--lr", "0.5",
                   "--mode", "half_async", "--checkpoint-dir", str(tmp_path / "ckpt"),
                   "--metrics-port", "0")
    log = (tmp_path / "shard.log").open("w")
    server = start_server(*shard_flags, stderr=log)
    try:
        assert server.ready["mode"] == "half_async"
        conf = tmp_path / "worker.toml"
        conf.write_text('algorithm = "accumulate"\ninner-steps = 2\n')
        out = subprocess.run(
            [sys.executable, "-m", "bitps.worker", "--servers", server.grpc_address,
             "--config", str(conf), "--push-codec", "int8key", "--compress-min-bytes", "0",
             "--steps", str(steps), "--seq-len", "32", "--batch-size", "8", "--corpus-bytes",
             "20000", "--threads", "1", "--json", "--metrics-port", "-1", "--log-every", "4"],
            cwd=ROOT, env={**os.environ, "BITPS_PLUGINS": f"{CODEC},{TRAINER}"},
            capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        events = [json.loads(line) for line in out.stdout.splitlines()]
        start, done = events[0], events[-1]
        assert done["event"] == "done" and done["last_loss"] < 0.8 * done["first_loss"], done

        pushes, keys, params = steps // every, start["keys"], start["params"]
        status = server.status()
        assert status.mode == "half_async"
        assert [(w.rank, w.clock) for w in status.workers] == [(0, pushes)]
        assert status.updates_applied == pushes * keys
        wire = pushes * (params + 4 * keys)  # int8key: a 4-byte scale and a byte per element
        assert done["push_wire_bytes"] == wire and done["pull_bytes"] == wire
        m = _metrics(server.ready["metrics_port"])
        assert m["bitps_push_codec_wire_bytes_total", "int8key"] == wire
        assert m["bitps_push_codec_decoded_bytes_total", "int8key"] == 4 * pushes * params

        before = _rule_state(server)
        assert len(before) == keys
        for fields, velocity in before.values():
            assert fields["step"] == pushes and fields["last_lr_scale"] == 0.5
            assert fields["grad_abs_sum"] > 0 and np.any(velocity)
        server.popen.send_signal(signal.SIGTERM)
        assert server.popen.wait(30) == 0
    finally:
        server.kill()
    server = start_server(*shard_flags, stderr=log)
    try:
        after = _rule_state(server)
        assert after.keys() == before.keys()
        for key, (fields, velocity) in before.items():
            assert after[key][0] == fields
            np.testing.assert_array_equal(after[key][1], velocity)
        assert server.status().updates_applied == pushes * keys
    finally:
        server.kill()
        log.close()
