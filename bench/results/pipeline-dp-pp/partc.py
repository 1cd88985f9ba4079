"""Part (c) of bitps-bench pipeline alone (run_dp_pp: every case of DP_PP_CASES x DP_PP_LRS x
DP_PP_SEEDS, about 25 minutes), written to /tmp/twobw-results/partc/pipeline.{json,md}."""
import json
import tempfile
from pathlib import Path

from bitps.bench import pipeline as bp
from bitps.bench.report import versions

out = Path("/tmp/twobw-results/partc")
with tempfile.TemporaryDirectory(prefix="twobw-c-") as tmp:
    rows, checks = bp.run_dp_pp(run_root=Path(tmp))
doc = {"scenario": "pipeline (c) only", "versions": versions(), "checks": checks}
(out / "pipeline.json").write_text(json.dumps(doc, indent=2))
listed = "\n".join(f"- {k}: {v}" for k, v in checks.items())
(out / "pipeline.md").write_text("# pipeline, part (c) only\n\n" + listed + "\n")
bp.append_section(out, "dp_pp_rows", bp._DPPP_TITLE, rows, bp._DPPP_COLUMNS, bp._dp_pp_notes(150))
print(json.dumps(checks, indent=1))
