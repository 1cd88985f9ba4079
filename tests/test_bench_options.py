"""``bitps-bench``'s options are its scenarios' dataclasses (bench/config.py): every
``bitps-bench SCENARIO --help`` lists exactly the fields with their defaults, the flags parse
back to the dataclass, and docs/benchmarks.md lists them as the code does. No scenario runs."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

from bitps.bench import config
from bitps.bench.__main__ import _ALL, SCENARIOS, build_parser
from bitps.bench.options import field_docs, from_args
from bitps.proto.settings import format_value
from tests.helpers import docs_generator

ROOT = Path(__file__).resolve().parents[1]
COMMON = {"-h", "--help", "--out"}  # every sub-command's, not a scenario's own
MEASURED = ("pushpull", "volume", "convergence", "codec", "kernels", "overlap", "memory",
            "e2e", "pipeline")


def _help_entries(text: str) -> dict[str, str]:
    """``--help``'s options: flag -> its entry (invocation and help) on one line."""
    body = text.split("\noptions:\n", 1)[1]
    entries: list[str] = []
    for line in body.splitlines():
        if re.match(r"^  -", line):
            entries.append(line.strip())
        elif line.startswith("   ") and entries:  # a wrapped line of the entry above
            entries[-1] += " " + line.strip()
    return {e.split()[0].rstrip(","): " ".join(e.split()) for e in entries}


def _help(name: str, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping: hyphens may break lines
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([name, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_help_lists_exactly_the_dataclass_fields_and_defaults(name, capsys, monkeypatch):
    cls = SCENARIOS[name].config
    entries = _help_entries(_help(name, capsys, monkeypatch))
    fields = dataclasses.fields(cls)
    assert [f for f in entries if f not in COMMON] == [
        "--" + f.name.replace("_", "-") for f in fields]
    for f in fields:
        entry = entries["--" + f.name.replace("_", "-")]
        shown = re.search(r"\(default: (.*)\)$", entry)
        assert shown, entry
        assert shown.group(1) == (format_value(f.default) or "none"), (f.name, entry)
        assert entry[:shown.start()].rstrip().endswith(field_docs(cls)[f.name]), entry


def test_every_sub_command_is_a_registered_scenario():
    sub = next(a for a in build_parser()._actions if a.dest == "scenario")
    assert list(sub.choices) == list(SCENARIOS)
    # chaos and scale need root (network namespaces) and run about 10 minutes: not in
    # bitps-bench all
    assert set(MEASURED) | {"all", "report", "compare", "chaos", "scale"} == set(SCENARIOS)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_no_flags_parse_to_the_dataclass_defaults(name):
    cls = SCENARIOS[name].config
    assert from_args(cls, build_parser().parse_args([name])) == cls()


def test_flags_parse_to_the_config_they_name():
    args = build_parser().parse_args(["pipeline", "--t-ms", "5", "5", "5", "--parts", "a", "c",
                                      "--ms", "2", "--quick", "--quiet-busy", "0.5"])
    assert from_args(config.PipelineBench, args) == config.PipelineBench(
        t_ms=(5.0, 5.0, 5.0), parts=("a", "c"), ms=(2,), quick=True, quiet_busy=0.5)
    args = build_parser().parse_args(["e2e", "--cases", "DDP fp32", "bitps sync fp32",
                                      "--straggler", "--model", "moe"])
    assert from_args(config.E2EBench, args) == config.E2EBench(
        cases=("DDP fp32", "bitps sync fp32"), straggler=True, model="moe")


@pytest.mark.parametrize("argv, message", [
    (["e2e", "--model", "huge"], "invalid choice: 'huge'"),
    (["pipeline", "--parts", "d"], "invalid choice: 'd'"),
    (["codec", "--mib", "lots"], "invalid int value: 'lots'"),
    (["pipeline", "--t-ms", "5", "5"], "expected 3 arguments"),
])
def test_a_bad_flag_is_refused_naming_it(argv, message, capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(argv)
    assert done.value.code == 2 and message in capsys.readouterr().err


def test_the_dataclasses_refuse_values_outside_their_choices():
    with pytest.raises(ValueError, match=r"E2EBench.placement: got 'far'; expected one of "
                                         r"colocated, own"):
        config.E2EBench(placement="far")
    with pytest.raises(ValueError, match=r"PipelineBench.parts: got \('a', 'd'\); expected "
                                         r"some of a, b, c"):
        config.PipelineBench(parts=("a", "d"))


def test_quick_sizes_each_scenario_as_the_help_says():
    assert config.CodecBench(quick=True).sized() == config.CodecBench(mib=8, repeats=2,
                                                                      quick=True)
    assert config.ConvergenceBench(quick=True, seeds=(3, 4)).sized().seeds == (0,)
    assert config.PipelineBench(quick=True, ms=(8, 4)).sized() == config.PipelineBench(
        quick=True, ms=(4,), rounds=1, parts=("a",), quiet_wait_s=0.0)
    assert config.PushPullBench(quick=True).sized() == config.PushPullBench(quick=True,
                                                                            idle_s=2.0)
    assert config.CodecBench().sized() == config.CodecBench()


def test_e2e_names_its_results_and_bounds_the_sweep():
    assert config.E2EBench().sized().name == "e2e-lm"
    assert config.E2EBench(model="moe", straggler=True).sized().name == "e2e-moe-straggler"
    quick = config.E2EBench(quick=True, model="moe").sized()
    assert (quick.name, quick.model, quick.steps, quick.lrs) == ("e2e-tiny", "tiny", 30,
                                                                  (3e-3,))
    assert config.E2EBench(steps=20, sweep_steps=60).sized().sweep_steps == 20
    assert config.E2EBench(name="mine").sized().name == "mine"


def test_all_runs_registered_scenarios_with_their_own_options():
    for name, options, _ in _ALL:
        SCENARIOS[name].config(**options)
    assert {name for name, _, _ in _ALL} == set(MEASURED)


def test_all_runs_every_scenario_then_the_report(monkeypatch, tmp_path):
    """``all`` goes through the registry: each scenario with its options (``--quick``: the
    smoke-test size, one e2e run, under ``<out>/quick``), then the report; a failed check
    anywhere fails it."""
    import bitps.bench.__main__ as cli
    import bitps.bench.summary as summary

    calls, status = [], {"codec": 1}
    for name in MEASURED:
        def fake(cfg, out, name=name):
            calls.append((name, cfg, out))
            return status.get(name, 0)

        monkeypatch.setitem(SCENARIOS, name, dataclasses.replace(SCENARIOS[name], run=fake))
    monkeypatch.setattr(summary, "write_report",
                        lambda out: calls.append(("report", None, out)) or out / "REPORT.md")
    assert cli.main(["--out", str(tmp_path), "all", "--quick"]) == 1
    assert [(n, out) for n, _, out in calls] == [(n, tmp_path / "quick") for n in (
        "volume", "pushpull", "codec", "kernels", "overlap", "memory", "convergence",
        "pipeline", "e2e", "report")]
    assert calls[0][1] == config.VolumeBench()
    assert calls[8][1] == config.E2EBench(model="lm", quick=True)
    assert all(cfg.quick for _, cfg, _ in calls[1:9])
    calls.clear()
    status.clear()
    assert cli.main(["all", "--out", str(tmp_path)]) == 0
    assert [cfg for n, cfg, _ in calls if n == "e2e"] == [
        config.E2EBench(model="lm"), config.E2EBench(model="moe"),
        config.E2EBench(model="lm", straggler=True)]
    assert {out for _, _, out in calls} == {tmp_path}


@pytest.mark.parametrize("name", MEASURED)
def test_each_scenario_runs_from_its_config(name):
    """``run(cfg, *, out)``: the config first (``None``: its defaults), the folder by name."""
    params = list(inspect.signature(importlib.import_module(f"bitps.bench.{name}").run)
                  .parameters.values())
    assert [p.name for p in params] == ["cfg", "out"]
    assert params[0].default is None and params[1].kind is inspect.Parameter.KEYWORD_ONLY


def _generator():
    return docs_generator()


def test_benchmarks_page_lists_the_options_as_generated():
    gen = _generator()
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert page == gen.render_benchmarks(page), (
        "docs/benchmarks.md's options section is out of date: run `make docs`")
    section = page.split(gen.BENCH_BEGIN, 1)[1]
    for name, scenario in SCENARIOS.items():
        part = section.split(f"#### `bitps-bench {name}`\n", 1)[1].split("\n#### ", 1)[0]
        for f in dataclasses.fields(scenario.config):
            row = next(line for line in part.splitlines()
                       if line.startswith(f"| `--{f.name.replace('_', '-')}"))
            assert row.split(" | ")[1] == (f"`{format_value(f.default)}`"
                                           if format_value(f.default) else "—"), row


def test_benchmarks_page_markers_are_required():
    gen = _generator()
    with pytest.raises(ValueError, match="found neither"):
        gen.render_benchmarks("# Benchmarks\n")
