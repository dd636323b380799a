"""`kmesh store serve`: the shared state store on a Unix socket (kmesh/store/server.py)."""

import argparse

from kmesh.cli.common import Commands
from kmesh.coord.future_use import RETENTIONS
from kmesh.extras import MOONCAKE, require


def _store_serve(args: argparse.Namespace) -> None:
    if args.remote is not None:
        require(MOONCAKE, "kmesh store serve --remote")
    from kmesh.state.tenants import load_api_keys
    from kmesh.store.remote.worker import remote_config
    from kmesh.store.server import parse_size, serve

    capacity = parse_size(args.capacity)
    api_keys = None if args.api_keys is None else load_api_keys(args.api_keys)
    remote = None
    if args.remote is not None:
        lend = (
            capacity if args.remote_lend is None else parse_size(args.remote_lend, "--remote-lend")
        )
        remote = remote_config(args.remote, args.remote_metadata, lend, args.remote_lease)

    def ready() -> None:
        print(f"kmesh store: listening on {args.socket}, capacity {capacity} bytes", flush=True)
        if remote is not None:
            print(
                f"kmesh store: in front of the remote tier at {remote.master} (metadata "
                f"{remote.metadata}), lending it {remote.lend} bytes at {remote.hostname}",
                flush=True,
            )

    serve(args.socket, capacity, args.lease, ready, api_keys, args.retention, remote)


def register(commands: Commands) -> None:
    store = commands.add_parser("store", help="the shared state store")
    store_commands = store.add_subparsers(dest="store_command", required=True)
    store_serve = store_commands.add_parser(
        "serve", help="serve keyed state in shared memory on a Unix socket until SIGTERM/SIGINT"
    )
    store_serve.add_argument("--socket", required=True, help="Unix socket path to listen on")
    store_serve.add_argument(
        "--capacity", required=True, help="payload bytes to hold, like 512M, 2G or 1048576"
    )
    store_serve.add_argument(
        "--lease",
        type=float,
        default=60.0,
        help="seconds a leader has to publish or renew before a waiter takes over (default 60)",
    )
    store_serve.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help='JSON {"API key": "tenant", ...}: engines give a key (KMESH_STORE_KEY) and see only '
        "their tenant's entries (default: no keys)",
    )
    store_serve.add_argument(
        "--retention",
        choices=RETENTIONS,
        default="future_use",
        help="what goes first when full: future_use (ended families, then undeclared entries "
        "least recently used, then declared ones furthest next use first; pins are soft) or lru "
        "(least recently used; pins are hard)",
    )
    store_serve.add_argument(
        "--remote",
        default=None,
        metavar="HOST:PORT",
        help="a Mooncake Store master (mooncake_master --rpc_port): stand in front of it as the "
        "remote tier shared with other machines' stores (docs/guide/store.md)",
    )
    store_serve.add_argument(
        "--remote-metadata",
        default=None,
        metavar="URL",
        help="the master's HTTP metadata server (default http://HOST:8080/metadata)",
    )
    store_serve.add_argument(
        "--remote-lend",
        default=None,
        metavar="SIZE",
        help="memory this machine lends to the remote tier: 0, or 16M or more (default: "
        "--capacity)",
    )
    store_serve.add_argument(
        "--remote-lease",
        type=float,
        default=5.0,
        help="seconds without a heartbeat before another machine takes over a remote claim "
        "(default 5)",
    )
    store_serve.set_defaults(func=_store_serve)
