"""pdbg serve RUN [--host 127.0.0.1] [--port 8000] [--allow-remote] [--public-url URL] [--at STEP] [--script PATH]
[--use-bundled-source] [--rank K]

The TUI in a web browser (textual-serve): each browser tab that opens the page gets its own `pdbg tui
RUN` process, driven over a websocket. It binds to loopback by default; from another machine, forward
the port (ssh -L 8000:127.0.0.1:8000 host). Binding to any other address needs --allow-remote: whoever
reaches the port can replay steps, which runs the recording's code on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import ipaddress
import shlex
import socket
import sys
from typing import Any

from recorder.errors import PdbgError

from .cmd_replay import _open, code_options, rank_option


class ServeError(PdbgError):
    """The server cannot start: a port in use, an address that cannot be bound, a missing package."""


def add_parser(sub: Any) -> None:
    doc = __doc__ or ""
    p = sub.add_parser("serve", help="the TUI in a web browser (textual-serve), on loopback by default",
                       description=doc.split("\n\n", 1)[1], usage=doc.split("\n\n")[0])
    p.add_argument("run", metavar="RUN", help="the recording or bundle")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1, loopback)")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on (default 8000)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a --host other than loopback; anyone who reaches the port can replay code")
    p.add_argument("--public-url", metavar="URL",
                   help="the address browsers use to reach the server, when it is not http://HOST:PORT (a proxy)")
    p.add_argument("--at", metavar="STEP", help="put the cursor on this step (an index or a selector)")
    code_options(p)
    rank_option(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    rec = _open(args.run, args.rank)  # a path that is not a recording: one line, before anything listens
    if args.at is not None:
        rec.step(args.at)
    if not 0 < args.port < 65536:
        raise ServeError(f"--port must be between 1 and 65535, not {args.port}")
    addresses = _resolve(args.host, args.port)
    remote = not all(ipaddress.ip_address(a[4][0].split("%")[0]).is_loopback for a in addresses)
    if remote and not args.allow_remote:
        raise ServeError(f"--host {args.host} is not a loopback address: anyone who reaches port {args.port} could "
                         "replay code from this recording; add --allow-remote to serve it there anyway, or keep "
                         "127.0.0.1 and forward the port (ssh -L)")
    try:
        from textual_serve.server import Server
    except ImportError as exc:
        raise ServeError(f"pdbg serve needs textual-serve ({exc}); install it with: pip install "
                         "'paperdebugger[serve]'") from None
    _check_bindable(args.host, args.port, addresses)
    if remote:
        print(f"pdbg: warning: serving on {_url_host(args.host)}:{args.port}, which is not loopback: anyone who "
              "reaches this port can replay steps of the recording, running its code on this machine", file=sys.stderr)
    url = args.public_url or f"http://{_url_host(args.host)}:{args.port}"
    server = _server_class(Server)(_tui_command(args), host=args.host, port=args.port, title=f"pdbg {args.run}",
                                   public_url=url.rstrip("/"))
    server.fixed_url = args.public_url is not None
    print(f"pdbg: serving {args.run} ({len(rec)} steps) on {url}; open it in a browser, Ctrl+C to stop", flush=True)
    try:
        server.serve()
    except OSError as exc:  # lost the port to another process after the check
        raise ServeError(_bind_problem(args.host, args.port, exc)) from None
    return 0


def _tui_command(args: argparse.Namespace) -> str:
    """The shell command each browser tab runs. Option values are joined to their options and RUN follows
    ``--``, so that a path or selector that starts with '-' (``pdbg serve -- -x.zarr``) reaches the child as
    it reached us, not as an option it refuses, which leaves the tab blank."""
    command = [sys.executable, "-m", "tui.cli", "tui", f"--rank={args.rank}"]
    if args.at is not None:
        command.append(f"--at={args.at}")
    if args.script is not None:
        command.append(f"--script={args.script}")
    if args.use_bundled_source:
        command.append("--use-bundled-source")
    return shlex.join([*command, "--", args.run])


def _server_class(server: type) -> type:
    """textual-serve's Server, writing into the page the address the browser reached it by.

    textual-serve writes the page's script, style and websocket URLs from its public URL, which would be
    http://HOST:PORT: on --host 0.0.0.0 a browser on another machine would look for them at 0.0.0.0 (itself),
    and through ``ssh -L 9000:127.0.0.1:8000`` at port 8000 of the laptop; the TUI would never load. Unless
    --public-url fixes the address (a proxy), each page's URLs follow the Host header its request came with.
    """

    class PageAddressServer(server):  # type: ignore[misc, valid-type]
        fixed_url = False

        async def handle_index(self, request: Any) -> Any:
            if not self.fixed_url:  # set and read with no await between: no other request interleaves
                self.public_url = f"{request.scheme}://{request.host}"
            return await super().handle_index(request)

        async def handle_websocket(self, request: Any) -> Any:
            tabs = self.__dict__.setdefault("_tabs", set())
            tab = asyncio.current_task()
            tabs.add(tab)
            try:
                return await super().handle_websocket(request)
            finally:
                tabs.discard(tab)

        async def on_shutdown(self, app: Any) -> None:
            """Ctrl+C or SIGTERM: end every open tab now. Left to aiohttp, each tab's websocket kept its handler
            waiting for the shutdown timeout (~20 s) before its TUI was told to quit; cancelled, the handler
            closes the websocket and quits the TUI at once (textual-serve's own path for a cancelled tab)."""
            tabs = list(self.__dict__.get("_tabs", ()))
            for tab in tabs:
                tab.cancel()
            await asyncio.gather(*tabs, return_exceptions=True)
            await super().on_shutdown(app)

    return PageAddressServer


def _resolve(host: str, port: int) -> list[Any]:
    """The addresses ``host`` names (``localhost``: the loopback ones), as getaddrinfo gives them."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ServeError(f"cannot listen on {host}: {exc.strerror or exc}; give an address of this machine "
                         "(--host 127.0.0.1 is the default)") from None


def _check_bindable(host: str, port: int, addresses: list[Any]) -> None:
    """Bind once, as the server will (address reuse on, as aiohttp sets it), to report a port in use or
    an address this machine does not have as one line, before the server prints anything."""
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
                probe.listen(1)
            except OSError as exc:
                raise ServeError(_bind_problem(host, port, exc)) from None


def _bind_problem(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use by another program; choose another with --port"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"not allowed to listen on port {port} ({exc.strerror}); ports below 1024 need privileges: "
                "use --port 8000")
    return (f"cannot listen on {host}:{port} ({exc.strerror or exc}); give an address of this machine "
            "(--host 127.0.0.1 is the default)")


def _url_host(host: str) -> str:
    """``host`` as it goes into a URL (IPv6 addresses in brackets)."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host
