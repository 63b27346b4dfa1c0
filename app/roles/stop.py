"""Stop a running llamarl app early, with a stop signed with the app's secret.

    python -m llamarl.app.roles.stop --store-addr HOST:PORT --app-id APP [--reason TEXT] [--secret-file PATH]

HOST is where trainer replica 0 runs (its store listens there only: ``localhost`` for a
local run), PORT the app's store port (0: derived from the app id, as the roles do), and
the secret is read the way the roles read it (``--secret-file``, else
``$LLAMARL_SECRET_FILE``, else ``$LLAMARL_SECRET``). Every role reads the stop within a
second and ends; the run ends non-zero, naming the reason (it did not finish its steps),
and keeps its checkpoints and metrics. A stop that is not signed with the app's secret
is ignored by every role (and counted under ``security/rejected_writes/stop``).
"""

from __future__ import annotations

import argparse
import getpass
import socket
import sys

from llamarl.app import errors
from llamarl.app import cli
from llamarl.app.control import frames
from llamarl.app import names
from llamarl.app.control import runtime
from llamarl.app.control.signed import USER, SignedStore
from llamarl.app.control.transport import Control


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m llamarl.app.roles.stop", description=__doc__.splitlines()[0])
    parser.add_argument("--store-addr", required=True,
                        help="host:port of the app's control store (port 0: derived from --app-id)")
    parser.add_argument("--app-id", required=True, help="the TorchX app id of the run to stop")
    parser.add_argument("--reason", default="", help="said in every role's log and in the app's error")
    parser.add_argument("--connect-timeout-s", type=float, default=10.0,
                        help="how long to try the store: a running app's answers at once")
    cli.add_secret_argument(parser)
    args = parser.parse_args(argv)
    host, sep, port = args.store_addr.rpartition(":")
    if not sep or not port.isdigit():
        parser.error(f"--store-addr must be 'host:port', got {args.store_addr!r}")
    try:
        # Never a new secret file: one that is missing names an app that never ran here
        # (a misspelt app id), and a fresh secret could stop nothing.
        secret = frames.read_secret(args.secret_file, create=False)
        store = runtime.connect_app_store(f"{host}:{names.store_port(int(port), args.app_id)}", args.app_id,
                                          args.connect_timeout_s)
    except (RuntimeError, ConnectionError, errors.ConfigError) as e:
        # Said in one line: the app id or the address is wrong, or the app has ended.
        raise SystemExit(f"llamarl.app.roles.stop: cannot stop {args.app_id}: {e} (`torchx run` prints the app id as "
                         "local_llamarl://torchx/<app id>)") from None
    control = Control(SignedStore(store, secret, USER))
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    reason = f"stopped by {who}" + (f": {args.reason}" if args.reason else "")
    if control.stop_reason() is not None:
        print(f"{args.app_id} is already stopping: {control.stop_reason()}")
        return
    control.request_stop(reason)
    print(f"asked {args.app_id} to stop ({reason})")


if __name__ == "__main__":
    main(sys.argv[1:])
