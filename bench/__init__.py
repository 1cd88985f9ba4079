"""The benchmark harness (``bitps-bench``): scenarios that run the real code path beside their
limit or peer in the same run and write JSON + Markdown under ``bench/results``."""
