"""Settings: one reader (``bitps.proto.settings``) for the flags, environment variables and
config file of ``bitps-server`` and ``bitps-worker``, defaults from the dataclasses, and
``docs/configuration.md`` rendered from the same definitions."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bitps import __version__
from bitps.proto.codecs import CodecConfig
from bitps.proto.settings import (
    FALSE_WORDS,
    TRUE_WORDS,
    Program,
    SettingError,
    format_value,
    from_field,
    option,
    parse_bool,
)
from bitps.ps import __main__ as server_cli
from bitps.ps.config import OptimizerConfig, ServerConfig
from bitps.worker.config import ClientConfig, OverlapConfig, PoolConfig, RunConfig
from bitps.worker.launch import launcher as launch
from tests.helpers import docs_generator

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
SPELLINGS = "1/true/yes/on or 0/false/no/off"

# Every flag and environment variable the two programs had before the settings reader: none
# may go away.
OLD_SERVER_FLAGS = (
    "shard-id num-shards host grpc-port data-port metrics-port mode staleness optimizer lr "
    "lr-warmup lr-decay lr-min-ratio momentum dampening nesterov no-nesterov beta1 beta2 eps "
    "weight-decay freeze-step onebit-chunk onebit-scale onebit-moments onebit-warmup-codes "
    "no-onebit-warmup-codes delta-history heartbeat-timeout pull-deadline token "
    "max-frame-bytes reject-nonfinite no-reject-nonfinite split-lr no-split-lr lookahead "
    "no-lookahead staleness-damping no-staleness-damping log-level").split()
OLD_WORKER_FLAGS = (
    "servers rank world-size steps batch-size seq-len corpus-bytes seed threads local-rank "
    "device metrics-port metrics-host token deadline step-delay push-codec pull-codec "
    "codec-chunk sign1-scale sparse-values compress-min-bytes clip-norm codec-seed overlap "
    "overlap-min-ratio bucket-bytes inflight-bytes profile profile-steps activation-pool "
    "pool-capacity pool-fraction pool-allocator pool-policy pool-min-block "
    "pool-min-tensor-bytes log-every json").split()
OLD_WORKER_ENV = {
    "servers": "BITPS_SERVERS", "rank": "RANK", "world-size": "WORLD_SIZE",
    "steps": "BITPS_STEPS", "threads": "BITPS_THREADS", "local-rank": "LOCAL_RANK",
    "device": "BITPS_DEVICE", "metrics-port": "BITPS_METRICS_PORT",
    "metrics-host": "BITPS_METRICS_HOST", "token": "BITPS_TOKEN",
    "push-codec": "BITPS_PUSH_CODEC", "pull-codec": "BITPS_PULL_CODEC",
    "codec-chunk": "BITPS_CODEC_CHUNK", "compress-min-bytes": "BITPS_COMPRESS_MIN_BYTES",
    "overlap": "BITPS_OVERLAP", "activation-pool": "BITPS_ACTIVATION_POOL"}


@pytest.fixture(scope="module")
def worker_cli():
    pytest.importorskip("torch")  # DemoConfig, which holds the model's defaults
    from bitps.worker import __main__ as cli

    return cli


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "settings.toml"
    path.write_text(text)
    return str(path)


# --- the two defects ---------------------------------------------------------------------


def test_worker_pool_defaults_are_pool_configs(worker_cli):
    args = worker_cli.build_parser().parse_args(["--activation-pool"])
    pool = PoolConfig()
    assert (args.pool_allocator, args.pool_policy) == (pool.allocator, pool.policy)
    assert (args.pool_capacity, args.pool_fraction, args.pool_min_block,
            args.pool_min_tensor_bytes) == (pool.capacity_bytes, pool.fraction,
                                            pool.min_block, pool.min_tensor_bytes)
    cfg, _ = worker_cli.parse_config(["--servers", "h:1", "--activation-pool"], environ={})
    assert cfg.run.activation_pool and cfg.pool == PoolConfig()


@pytest.mark.parametrize("text, on", [("false", False), ("0", False), ("no", False),
                                      ("OFF", False), ("", False), ("true", True), ("1", True),
                                      ("Yes", True), (" on ", True)])
def test_activation_pool_variable_reads_like_every_boolean(worker_cli, text, on):
    cfg, _ = worker_cli.parse_config(["--servers", "h:1"],
                                     environ={"BITPS_ACTIVATION_POOL": text})
    assert cfg.run.activation_pool is on


# --- booleans ----------------------------------------------------------------------------


def test_parse_bool_spellings():
    for word in TRUE_WORDS + tuple(w.upper() for w in TRUE_WORDS):
        assert parse_bool(word, source="X") is True
    for word in FALSE_WORDS + tuple(w.title() for w in FALSE_WORDS):
        assert parse_bool(word, source="X") is False
    with pytest.raises(SettingError, match=r"^X: got 'maybe'; expected a boolean, "
                                           + re.escape(SPELLINGS)):
        parse_bool("maybe", source="X")


@pytest.mark.parametrize("name, environ", [
    ("server", {"BITPS_SPLIT_LR": "nah"}), ("worker", {"BITPS_ACTIVATION_POOL": "maybe"})])
def test_bad_boolean_variable_is_refused_naming_it(worker_cli, name, environ):
    cli = server_cli if name == "server" else worker_cli
    (var, value), = environ.items()
    with pytest.raises(SettingError) as err:
        cli.parse_config(["--servers", "h:1"] if name == "worker" else [], environ=environ)
    assert var in str(err.value) and repr(value) in str(err.value)
    assert SPELLINGS in str(err.value)


def test_bad_boolean_variable_exits_2_with_the_message(monkeypatch, capsys):
    monkeypatch.setenv("BITPS_LOOKAHEAD", "maybe")
    assert server_cli.main([]) == 2
    assert "environment variable BITPS_LOOKAHEAD: got 'maybe'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--nesterov=maybe"], ["--nesterov", "2"]])
def test_bad_boolean_flag_is_refused_naming_it(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        server_cli.parse_config(argv, environ={})
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--nesterov" in err and SPELLINGS in err and repr(argv[-1].split("=")[-1]) in err


def test_negative_boolean_flag_takes_no_value(capsys):
    with pytest.raises(SystemExit):
        server_cli.parse_config(["--no-lookahead=1"], environ={})
    assert "--no-lookahead takes no value" in capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    ([], False), (["--nesterov"], True), (["--nesterov=yes"], True), (["--nesterov", "ON"], True),
    (["--nesterov=0"], False), (["--nesterov", "--no-nesterov"], False),
    (["--no-nesterov", "--nesterov"], True)])
def test_boolean_flag_forms(argv, expected):
    cfg, _ = server_cli.parse_config(argv, environ={})
    assert cfg.optimizer.nesterov is expected


def test_boolean_flag_before_another_flag_takes_no_value():
    cfg, _ = server_cli.parse_config(["--staleness-damping", "--mode", "ssp"], environ={})
    assert cfg.staleness_damping and cfg.mode == "ssp"


# --- defaults, names, precedence -----------------------------------------------------------


def test_server_defaults_are_the_dataclasses():
    cfg, args = server_cli.parse_config([], environ={})
    assert cfg == ServerConfig() and cfg.optimizer == OptimizerConfig()
    assert args.log_level == "INFO" and args.config is None


def test_worker_defaults_are_the_dataclasses(worker_cli):
    from bitps.worker.demo import DemoConfig

    cfg, _ = worker_cli.parse_config(["--servers", "a:1,b:2"], environ={})
    assert cfg.client == ClientConfig(servers=("a:1", "b:2"))
    assert (cfg.overlap, cfg.pool, cfg.run, cfg.demo) == (OverlapConfig(), PoolConfig(),
                                                          RunConfig(), DemoConfig())


def test_every_old_flag_and_variable_is_kept(worker_cli):
    assert {f"--{f}" for f in OLD_SERVER_FLAGS} <= _flags(server_cli.build_parser())
    assert {f"--{f}" for f in OLD_WORKER_FLAGS} <= _flags(worker_cli.build_parser())
    for s in server_cli.PROGRAM.settings:  # every shard flag had BITPS_<FLAG>
        assert s.env == "BITPS_" + s.name.upper().replace("-", "_"), s
    envs = {s.name: s.env for s in worker_cli.program().settings}
    assert {k: envs[k] for k in OLD_WORKER_ENV} == OLD_WORKER_ENV


def test_torchrun_variables_name_the_rank(worker_cli):
    cfg, _ = worker_cli.parse_config([], environ={"BITPS_SERVERS": "h:1,h:2", "RANK": "1",
                                                  "WORLD_SIZE": "3", "LOCAL_RANK": "2"})
    assert (cfg.client.servers, cfg.client.rank, cfg.client.world_size,
            cfg.run.local_rank) == (("h:1", "h:2"), 1, 3, 2)


def test_pull_codec_shares_the_codec_flags(worker_cli):
    cfg, _ = worker_cli.parse_config(["--servers", "h:1", "--push-codec", "sparse",
                                      "--pull-codec", "sign1", "--codec-chunk", "256"],
                                     environ={})
    assert cfg.encoder.push_codec == CodecConfig(name="sparse", chunk=256)
    assert cfg.encoder.pull_codec == CodecConfig(name="sign1", chunk=256)


def test_build_parser_reads_no_environment(monkeypatch, worker_cli):
    """The parser alone parses a command line the same anywhere: a variable set, even one
    that cannot be read, changes nothing (parse_config is where the environment counts)."""
    for name in ("BITPS_GRPC_PORT", "BITPS_STEPS", "BITPS_ACTIVATION_POOL", "RANK"):
        monkeypatch.setenv(name, "not a value")
    args = server_cli.build_parser().parse_args(["--mode", "ssp", "--num-shards", "2"])
    assert (args.mode, args.num_shards, args.grpc_port) == ("ssp", 2, 0)
    args = worker_cli.build_parser().parse_args(["--servers", "h:1", "--json"])
    assert (args.steps, args.activation_pool, args.rank, args.json) == (150, False, 0, True)


@pytest.mark.parametrize("flag, env, in_file, expected, source", [
    (True, True, True, 5, "--staleness"),
    (False, True, True, 4, "BITPS_STALENESS"),
    (False, False, True, 3, "config file"),
    (False, False, False, 2, "default"),
    (True, False, True, 5, "--staleness"),
])
def test_precedence_flag_env_file_default(tmp_path, flag, env, in_file, expected, source):
    path = _write(tmp_path, "staleness = 3\n" if in_file else "mode = 'ssp'\n")
    argv = ["--config", path] + (["--staleness", "5"] if flag else [])
    r = server_cli.PROGRAM.parse(argv, environ={"BITPS_STALENESS": "4"} if env else {})
    assert r["staleness"] == expected and r.sources["staleness"].startswith(source)
    assert r["mode"] == "ssp" or in_file  # the file's other keys still count


def test_flag_equal_to_the_default_still_wins(tmp_path):
    path = _write(tmp_path, "staleness = 3\nsplit-lr = false\n")
    cfg, _ = server_cli.parse_config(["--config", path, "--staleness", "2", "--split-lr"],
                                     environ={"BITPS_STALENESS": "4"})
    assert cfg.staleness == 2 and cfg.split_lr


def test_empty_variable_is_unset_except_for_text(tmp_path):
    path = _write(tmp_path, 'grpc-port = 5000\ntoken = "secret"\n')
    cfg, _ = server_cli.parse_config(["--config", path],
                                     environ={"BITPS_GRPC_PORT": "", "BITPS_TOKEN": ""})
    assert cfg.grpc_port == 5000 and cfg.token == ""


def test_bad_variable_names_it_and_what_was_expected():
    with pytest.raises(SettingError, match=r"BITPS_GRPC_PORT: got 'x'; expected an integer"):
        server_cli.parse_config([], environ={"BITPS_GRPC_PORT": "x"})
    with pytest.raises(SettingError, match=r"BITPS_MODE: got 'bsp'; expected one of sync, "
                                           r"async, ssp"):
        server_cli.parse_config([], environ={"BITPS_MODE": "bsp"})


def test_dataclass_checks_still_apply_to_every_source():
    with pytest.raises(ValueError, match="staleness must be >= 0, got -1"):
        server_cli.parse_config([], environ={"BITPS_STALENESS": "-1"})


# --- the config file ---------------------------------------------------------------------


def test_unknown_key_is_refused_with_its_name_and_the_valid_keys(tmp_path):
    path = _write(tmp_path, "grpc_port = 50051\n")
    with pytest.raises(SettingError) as err:
        server_cli.parse_config(["--config", path], environ={})
    msg = str(err.value)
    assert "unknown key 'grpc_port'" in msg and "did you mean 'grpc-port'?" in msg
    assert path in msg
    assert all(s.name in msg for s in server_cli.PROGRAM.settings)


def test_table_is_an_unknown_key(tmp_path):
    with pytest.raises(SettingError, match="unknown key 'server'"):
        server_cli.parse_config(["--config", _write(tmp_path, "[server]\nmode = 'ssp'\n")],
                                environ={})


@pytest.mark.parametrize("line, expected", [
    ('staleness = "3"', r"key 'staleness': got '3' \(string\); expected an integer"),
    ("staleness = true", r"key 'staleness': got True \(boolean\); expected an integer"),
    ('nesterov = "yes"', r"key 'nesterov': got 'yes' \(string\); expected a boolean"),
    ("lr = [1]", r"key 'lr': got \[1\] \(array\); expected a number"),
    ('mode = "bsp"', r"key 'mode': got 'bsp'; expected one of sync, async, ssp"),
    ("host = 1", r"key 'host': got 1 \(integer\); expected a string"),
])
def test_wrong_type_names_key_value_and_expected_type(tmp_path, line, expected):
    with pytest.raises(SettingError, match=expected):
        server_cli.parse_config(["--config", _write(tmp_path, line + "\n")], environ={})


def test_file_values_of_every_type(tmp_path):
    path = _write(tmp_path, 'host = "0.0.0.0"\nlr = 1\nnesterov = true\nnum-shards = 2\n'
                            'shard-id = 1\nonebit-moments = "shard"\n'
                            # the rule's own section is kept for the rule that runs
                            'optimizer = "onebit_adam"\n')
    cfg, _ = server_cli.parse_config(["--config", path], environ={})
    assert (cfg.host, cfg.optimizer.lr, cfg.optimizer.nesterov, cfg.num_shards, cfg.shard_id,
            cfg.optimizer.rule_config.moments) == ("0.0.0.0", 1.0, True, 2, 1, "shard")
    assert isinstance(cfg.optimizer.lr, float)


def test_missing_or_broken_file_is_refused(tmp_path):
    with pytest.raises(SettingError, match="no-such.toml"):
        server_cli.parse_config(["--config", str(tmp_path / "no-such.toml")], environ={})
    with pytest.raises(SettingError, match="is not valid TOML"):
        server_cli.parse_config(["--config", _write(tmp_path, "mode = \n")], environ={})


def test_worker_reads_a_config_file(tmp_path, worker_cli):
    path = _write(tmp_path, 'servers = "h:1"\nactivation-pool = true\npool-policy = "lru"\n'
                            "batch-size = 4\n")
    cfg, args = worker_cli.parse_config(["--config", path], environ={})
    assert cfg.run.activation_pool and cfg.pool.policy == "lru" and cfg.demo.batch_size == 4
    assert args.config == Path(path)


# --- --version ---------------------------------------------------------------------------


def test_version(capsys, worker_cli):
    for parser in (server_cli.build_parser(), worker_cli.build_parser()):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["--version"])
        assert exit_.value.code == 0
        assert capsys.readouterr().out == f"bitps {__version__}\n"


def test_server_version_from_the_command_line():
    out = subprocess.run([sys.executable, "-m", "bitps.ps", "--version"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == f"bitps {__version__}\n"


# --- the reader's own rules ----------------------------------------------------------------


def test_defaults_and_choices_come_from_the_field():
    s = from_field(ServerConfig, "mode", help="h")
    assert (s.default, tuple(s.choices), s.env, s.flag) == ("async", ("sync", "async", "ssp"),
                                                      "BITPS_MODE", "--mode")
    with pytest.raises(TypeError, match="no field 'modes'"):
        from_field(ServerConfig, "modes", help="h")
    with pytest.raises(TypeError, match="no plain default"):
        from_field(ServerConfig, "optimizer", help="h")


def test_program_refuses_two_settings_of_one_name():
    with pytest.raises(TypeError, match="share the name"):
        Program("p", "d", (option("x", default=1, help="h"), option("x", default=2, help="h")))


def test_launch_restates_no_shard_default():
    args = launch.build_parser().parse_args([])
    assert (args.mode, args.staleness, args.optimizer) == (None, None, None)


# --- docs/configuration.md -------------------------------------------------------------------


def _generator():
    return docs_generator()


def test_configuration_page_is_generated(worker_cli):
    assert DOC.read_text(encoding="utf-8") == _generator().render(), (
        "docs/configuration.md is out of date: run `make docs`")


def _section(text: str, prog: str) -> str:
    """The part of the page under the heading naming ``prog``, up to the next heading."""
    m = re.search(rf"^#+ `{re.escape(prog)}`\n(.*?)(?=^#|\Z)", text, re.M | re.S)
    assert m, f"no section for {prog}"
    return m.group(1)


def _row(section: str, flag: str) -> str:
    rows = [line for line in section.splitlines()
            if line.startswith("| `") and re.search(rf"`{re.escape(flag)}[ `,]", line)]
    assert len(rows) == 1, (flag, rows)
    return rows[0]


def test_every_flag_is_documented_with_its_real_default(worker_cli):
    text = DOC.read_text(encoding="utf-8")
    for program in (server_cli.PROGRAM, worker_cli.program()):
        section = _section(text, program.prog)
        for s in program.settings:
            cells = [c.strip() for c in _row(section, s.flag).split(" | ")]
            assert f"`{format_value(s.default)}`" == cells[4], (s.name, cells)
            assert cells[1] == (f"`{s.env}`" if s.env else "—") and cells[2] == f"`{s.name}`"
    bench = pytest.importorskip("bitps.bench.__main__")
    parsers = [launch.build_parser(), bench.build_parser()]
    while parsers:
        parser = parsers.pop()
        section = _section(text, parser.prog)
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                parsers += a.choices.values()
            elif a.option_strings and not isinstance(a, argparse._HelpAction):
                default = a.default
                shown = "—" if default in (None, [], argparse.SUPPRESS) or isinstance(
                    a, argparse._VersionAction) else f"`{format_value(default)}`"
                assert _row(section, a.option_strings[0]).split(" | ")[1] == shown, a


def test_documented_examples_are_valid_config_files(tmp_path, worker_cli):
    gen = _generator()
    cfg, _ = server_cli.parse_config(["--config", _write(tmp_path, gen.SERVER_EXAMPLE)],
                                     environ={})
    assert (cfg.mode, cfg.optimizer.name, cfg.lookahead) == ("ssp", "adamw", False)
    cfg, _ = worker_cli.parse_config(["--config", _write(tmp_path, gen.WORKER_EXAMPLE)],
                                     environ={})
    assert cfg.run.activation_pool and cfg.encoder.push_codec.name == "sign1"
