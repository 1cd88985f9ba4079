"""``bitps-status``: the hang doctor. Asks every shard for its ``Status`` and says who waits
for whom.

    bitps-status --servers 10.0.0.1:50051,10.0.0.2:50051 [--token T] [--watch 2] [--json]

Each shard reports, per worker rank, its clock, whether it is live, left or dropped, how long
ago it was heard from, how far it is ahead of the slowest live worker and behind the fastest,
and its held pulls: the step each one is for, how long it has waited and *whom it waits for*
(the ranks the consistency mode needs to push or advance). ``waits.merge`` folds the replies
into one document (``--json`` prints it, one line per round with ``--watch``); ``waits.render``
prints rich tables and, for every waited-for rank, one plain sentence::

    rank 1 is waited for by rank 0 on shard 0 for 3.2 s; last heard 0.4 s ago (it still
    heartbeats: its step is stuck or slow; it is at clock 0)

A shard that does not answer is reported as such and the exit status is 1 (0: every shard
answered, whatever it said; 2: a bad flag). The diagnosis is the library
:mod:`bitps.worker.launch.waits`, whose ``describe_wait`` is also the line ``bitps-worker``
logs while a pull waits; this module is only the program.

No torch and no ``PSClient`` here: plain gRPC stubs, so it runs anywhere the shards are
reachable (``BITPS_SERVERS`` and ``BITPS_TOKEN`` are the worker's variables too).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

from rich.console import Console

from bitps.proto.keys import KeyFileError
from bitps.proto.settings import Program, SettingError, option
from bitps.worker.config import tls_settings
from bitps.worker.launch.waits import fetch, merge, render
from bitps.worker.transport.control import tls_channel_credentials

__all__ = ["PROGRAM", "main"]

PROGRAM = Program("bitps-status", "Ask every shard who waits for whom (the hang doctor).", (
    option("servers", default="", metavar="HOST:PORT,...",
           help="comma-separated gRPC host:port of every shard, in shard-id order"),
    option("token", default="", help="shared secret of the shards (empty = none)"),
    *tls_settings(),  # the worker's settings and variables (BITPS_TLS_CA_FILE, ...)
    # No environment twins below: BITPS_JSON is the worker's own (RunConfig.json), and the
    # servers and token are the only settings a worker's environment should hand over.
    option("watch", default=0.0, metavar="SECONDS", env=None,
           help="ask again every SECONDS until Ctrl-C (0 = once)"),
    option("json", default=False, env=None,
           help="print the merged document as JSON (one line per round) instead of tables"),
    option("timeout", default=5.0, metavar="SECONDS", env=None,
           help="how long each shard may take to answer before it is reported as not "
                "answering"),
), epilog="Exit status: 0 when every shard answered, 1 when one did not, 2 for a bad flag.")


# -- the program ---------------------------------------------------------------------------------
def _round(servers: Sequence[str], r, out: Console, credentials) -> bool:
    doc = merge(fetch(servers, token=r["token"], timeout_s=r["timeout"],
                      credentials=credentials))
    if r["json"]:
        print(json.dumps(doc), flush=True)
    else:
        render(doc, out)
    return doc["ok"]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags (``--servers`` required), ask every shard, print; ``--watch``: again every
    so many seconds until Ctrl-C. Returns 1 when a shard did not answer (the last round's),
    2 for a bad setting, else 0."""
    try:
        r = PROGRAM.parse(argv)
    except SettingError as err:
        print(f"bitps-status: {err}", file=sys.stderr)
        return 2
    servers = [s.strip() for s in r["servers"].split(",") if s.strip()]
    if not servers or r["watch"] < 0 or not r["timeout"] > 0:
        print(f"bitps-status: need --servers HOST:PORT,... (got {r['servers']!r}), --watch >= "
              f"0 (got {r['watch']}) and --timeout > 0 (got {r['timeout']})", file=sys.stderr)
        return 2
    try:
        credentials = tls_channel_credentials(r["tls-ca-file"], r["tls-cert-file"],
                                              r["tls-key-file"])
    except KeyFileError as err:
        print(f"bitps-status: {err}", file=sys.stderr)
        return 2
    out, ok = Console(highlight=False), False
    try:
        ok = _round(servers, r, out, credentials)
        while r["watch"]:
            time.sleep(r["watch"])
            if not r["json"]:
                out.clear()
            ok = _round(servers, r, out, credentials)
    except KeyboardInterrupt:
        pass  # --watch ends with Ctrl-C; the status is the last round's
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
