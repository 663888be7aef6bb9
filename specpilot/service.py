"""What every service process shares: its command line, its connection, its micro registration,
and a clean stop on SIGTERM/SIGINT.

A service runs as ``python -m specpilot.services.<name> [--data DIR] [--bundle DIR] [--nats URL]``. Its
bundle (`specpilot.bundles`: its certificate, the CA, the server URL) is ``--bundle`` or
``DATA/bundles/<name>``, and must be its own; the server is ``--nats``, else (without ``--bundle``) the
local server of ``--data`` that ``specpilot up`` started, else the bundle's URL. The bundle's folder is exported
as ``SPECPILOT_BUNDLE`` so every sandbox this process starts hides it (`specpilot.sandbox`). Each
service announces its version and stock tree in its micro metadata (`specpilot.handshake`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from specpilot import __version__, bundles, bus, handshake, natsd, paths
from specpilot.bundles import Bundle
from specpilot.errors import UserError


@dataclass(frozen=True)
class ServiceConfig:
    name: str
    nats: str
    bundle: Bundle
    data: Path
    connect_timeout_s: float = 20.0
    args: argparse.Namespace | None = None  # the service's own flags
    # What every discovery reply carries (micro metadata): the version handshake, and what the service says
    # of its state while it runs (the memory service: ``recording``), shown by `specpilot status`
    announced: dict[str, str] = field(default_factory=dict)


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, default=None,
                        help="data directory (default: $SPECPILOT_DATA or ~/.local/share/specpilot)")
    parser.add_argument("--nats", default=None,
                        help="NATS URL of a running server (default: the bundle's, else the local one)")
    parser.add_argument("--bundle", type=Path, default=None,
                        help="this host's bundle folder from `specpilot init` (default: DATA/bundles/<name>)")
    parser.add_argument("--connect-timeout", type=float, default=20.0,
                        help="seconds to keep retrying a server that does not answer")


def resolve(name: str, args: argparse.Namespace) -> ServiceConfig:
    """Where ``name`` connects and as whom; a bundle that is missing or not ``name``'s stops it here."""
    data = Path(args.data or paths.default_data_dir())
    bundle = Bundle.load(args.bundle or bundles.bundle_path(data, name), expect=name)
    url = args.nats
    if url is None and args.bundle is None and (local := natsd.running(data)) is not None:
        url = local.url
    return ServiceConfig(name=name, nats=url or bundle.nats, bundle=bundle, data=data,
                         connect_timeout_s=args.connect_timeout, args=args)


Body = Callable[[bus.Bus, asyncio.Event], Awaitable[None]]


async def run(cfg: ServiceConfig, description: str, body: Body | None = None,
              endpoints: dict[str, Callable[[dict], Awaitable[dict]]] | None = None) -> None:
    """Connect, register as a micro service, run ``body`` until a stop signal, then drain."""
    os.environ["SPECPILOT_BUNDLE"] = str(cfg.bundle.path.resolve())
    b = await bus.connect(cfg.nats, cfg.bundle, name=cfg.name, connect_timeout_s=cfg.connect_timeout_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    cfg.announced.update(handshake.identity())  # the same dict object: later changes reach every reply
    svc = await b.serve(cfg.name, __version__, description, endpoints or {}, metadata=cfg.announced)
    logging.getLogger(cfg.name).info("%s up on %s", cfg.name, cfg.nats)
    try:
        if body is None:
            await stop.wait()
        else:
            task = asyncio.create_task(body(b, stop))
            waiter = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                task.result()  # surface a crash
            else:
                await asyncio.wait_for(task, timeout=30)
    finally:
        await svc.stop()  # type: ignore[attr-defined]
        await b.close()


Factory = Callable[[ServiceConfig], tuple[Body | None, dict[str, Callable[[dict], Awaitable[dict]]]]]


def main(name: str, description: str, make: Factory | None = None, argv: list[str] | None = None,
         add_args: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """Entry point of ``python -m specpilot.services.<name>``; ``make`` builds the body and endpoints.

    ``add_args`` adds the service's own flags; ``make`` then finds them on ``cfg.args``."""
    parser = argparse.ArgumentParser(prog=f"python -m specpilot.services.{name}", description=description)
    add_connection_flags(parser)
    parser.add_argument("--log-level", default="INFO")
    if add_args:
        add_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    try:
        cfg = resolve(name, args)
        body, endpoints = make(cfg) if make else (None, {})
        asyncio.run(run(cfg, description, body, endpoints))
    except UserError as exc:
        raise SystemExit(f"{name}: {exc}") from None

