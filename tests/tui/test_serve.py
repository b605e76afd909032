"""``pdbg serve``: the TUI in a browser (textual-serve), driven in headless Chromium.

The page draws the terminal on a canvas, so what the app shows is read where the browser receives
it: the websocket frames (the app's terminal output), from Chromium's performance log. The last
screenshot is saved as ``serve.png`` in the test's temporary directory, or in ``$PDBG_ARTIFACTS``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli import ROOT, env, pdbg
from tests.tui.recordings import nan_run

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# Without the background-networking flags Chromium keeps trying hosts this closed network refuses.
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,900")
WAIT_S = 60.0


@pytest.fixture(scope="module")
def run_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return nan_run(tmp_path_factory.mktemp("serve") / "nan.zarr")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, ready: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    """Poll ``ready`` until it returns something true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = ready()
        if found:
            return found
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture
def server(run_path: Path) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    port = free_port()
    with serving(["serve", str(run_path), "--port", str(port)], port, ROOT) as (proc, first):
        assert first.startswith(f"pdbg: serving {run_path} (20 steps) on http://127.0.0.1:{port}"), first
        yield port, proc


@contextlib.contextmanager
def serving(args: list[str], port: int, cwd: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``pdbg ARGS`` listening on ``port``, with the line it printed first; stopped with Ctrl+C at the end."""
    proc = subprocess.Popen([sys.executable, "-m", "tui.cli", *args], cwd=cwd, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        first = read_line(proc)
        assert first.startswith("pdbg: serving "), first
        wait_for(f"the server to listen on port {port}", lambda: accepts(port) or proc.poll() is not None)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        yield proc, first
    finally:
        interrupt(proc)


def interrupt(proc: subprocess.Popen[str]) -> None:
    """Stop a server as Ctrl+C does; killed if it is still there 20 s later."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def read_line(proc: subprocess.Popen[str], timeout: float = WAIT_S) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            pytest.fail("pdbg serve printed nothing")
    return proc.stdout.readline()


class Browser:
    """Headless Chromium through Debian's chromedriver, with its websocket frames readable."""

    def __init__(self, profile: Path) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service

        options = Options()
        options.binary_location = CHROMIUM
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
        self.driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        self.driver.set_page_load_timeout(WAIT_S)
        self.received = ""

    def frames(self) -> str:
        """Everything the page received on its websockets so far, as text."""
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message["method"] == "Network.webSocketFrameReceived":
                response = message["params"]["response"]
                data = response["payloadData"]
                self.received += base64.b64decode(data).decode("utf-8", "replace") if response["opcode"] == 2 else data
        return self.received

    def press(self, key: str) -> None:
        from selenium.webdriver.common.by import By

        self.driver.find_element(By.CSS_SELECTOR, "textarea.xterm-helper-textarea").send_keys(key)

    def close(self) -> None:
        self.driver.quit()


@pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                    reason="needs Debian's chromium and chromium-driver (make test installs them)")
def test_the_tui_in_a_browser(server: tuple[int, subprocess.Popen[str]], tmp_path: Path) -> None:
    """The page opens the TUI: the timeline draws the recorded steps, and a key press in the browser
    moves the cursor (the step pane then shows step 1)."""
    from selenium.webdriver.common.keys import Keys

    port, _ = server
    browser = Browser(tmp_path / "profile")
    try:
        browser.driver.get(f"http://127.0.0.1:{port}/")
        wait_for("the timeline", lambda: all(s in browser.frames() for s in
                                             ("Model Stack", "Eq. 2 smooth_relu", "step 0", "complete · 20 steps")))
        assert "step 1 " not in browser.frames()
        start = len(browser.received)
        browser.press(Keys.ARROW_RIGHT)
        wait_for("the cursor to move to step 1", lambda: "step 1 " in browser.frames()[start:])
        assert "iteration 0" in browser.received[start:]
        shot = Path(os.environ.get("PDBG_ARTIFACTS", tmp_path)) / "serve.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        assert browser.driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    finally:
        browser.close()


def test_a_port_in_use_is_one_line(run_path: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = pdbg("serve", str(run_path), "--port", str(port), cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == f"pdbg: error: port {port} on 127.0.0.1 is in use by another program; choose another " \
                         "with --port\n"


def test_an_address_that_cannot_be_bound_is_one_line(run_path: Path, tmp_path: Path) -> None:
    """192.0.2.1 (documentation's TEST-NET-1) is an address of no machine here."""
    out = pdbg("serve", str(run_path), "--host", "192.0.2.1", "--allow-remote", "--port", str(free_port()),
               cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("pdbg: error: cannot listen on 192.0.2.1:") and out.stderr.count("\n") == 1
    out = pdbg("serve", str(run_path), "--host", "no-such-host.invalid", "--allow-remote", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("pdbg: error: cannot listen on no-such-host.invalid")


def test_binding_beyond_loopback_needs_a_flag_and_warns(run_path: Path, tmp_path: Path) -> None:
    out = pdbg("serve", str(run_path), "--host", "0.0.0.0", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "is not a loopback address" in out.stderr and "--allow-remote" in out.stderr
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tui.cli", "serve", str(run_path), "--host", "0.0.0.0",
                             "--allow-remote", "--port", str(port)], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        warning = proc.stderr.readline()
        assert warning.startswith(f"pdbg: warning: serving on 0.0.0.0:{port}, which is not loopback: anyone who "
                                  "reaches this port can replay steps"), warning
        wait_for(f"the server to listen on port {port}", lambda: accepts(port) or proc.poll() is not None)
        assert proc.poll() is None
    finally:
        interrupt(proc)


@pytest.mark.parametrize("args, message", [
    (["--port", "0"], "--port must be between 1 and 65535, not 0"),
    (["--at", "Eq. 99"], "no step"),
])
def test_bad_options_are_one_line(run_path: Path, tmp_path: Path, args: list[str], message: str) -> None:
    out = pdbg("serve", str(run_path), *args, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("pdbg: error: ") and out.stderr.count("\n") == 1
    assert message in out.stderr


def test_not_a_recording_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    out = pdbg("serve", str(tmp_path / "notes.txt"), cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("pdbg: error: ") and out.stderr.count("\n") == 1


def page(port: int, host: str) -> str:
    """The page a browser that reached the server as ``host`` is given."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request("GET", "/", headers={"Host": host})
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def terminal_output(port: int, until: str) -> str:
    """What a browser tab's terminal receives over the websocket, read until ``until`` appears or the
    connection ends (the tab's process exited)."""
    import aiohttp

    received: list[str] = []

    async def read() -> None:
        async with aiohttp.ClientSession() as session, \
                session.ws_connect(f"http://127.0.0.1:{port}/ws?width=100&height=30") as ws:
            while until not in "".join(received):
                message = await ws.receive()
                if message.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                    return
                data = message.data
                received.append(data.decode("utf-8", "replace") if isinstance(data, bytes) else data)

    async def read_for_a_while() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(read(), WAIT_S)

    asyncio.run(read_for_a_while())
    return "".join(received)


def test_the_page_points_at_the_address_the_browser_used(server: tuple[int, subprocess.Popen[str]]) -> None:
    """A browser on another machine (--host 0.0.0.0), or one at the end of ssh -L 9000:127.0.0.1:8000, loads
    the page's script and websocket from the address it reached the server by, not from the bind address."""
    port, _ = server
    html = page(port, "gpu-host.example:9000")
    assert 'data-session-websocket-url="ws://gpu-host.example:9000/ws"' in html
    assert '<script src="http://gpu-host.example:9000/static/js/textual.js">' in html
    assert "127.0.0.1" not in html


def test_public_url_still_names_the_address(run_path: Path) -> None:
    port = free_port()
    with serving(["serve", str(run_path), "--port", str(port), "--public-url", "https://portal.example/pdbg/"],
                 port, ROOT):
        html = page(port, f"127.0.0.1:{port}")
    assert 'data-session-websocket-url="wss://portal.example/pdbg/ws"' in html


def test_a_path_that_starts_with_a_dash(run_path: Path, tmp_path: Path) -> None:
    """pdbg serve -- -x.zarr: each tab's TUI opens the recording (its process was given -x.zarr as an option,
    refused it and exited: a blank page)."""
    shutil.copytree(run_path, tmp_path / "-x.zarr")
    port = free_port()
    with serving(["serve", "--port", str(port), "--", "-x.zarr"], port, tmp_path):
        seen = terminal_output(port, "complete · 20 steps")
    assert "complete · 20 steps" in seen and "-x.zarr" in seen


def test_the_warning_writes_an_ipv6_address_in_brackets(run_path: Path) -> None:
    """--host :: read "serving on :::8000", the port lost among the colons."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tui.cli", "serve", str(run_path), "--host", "::", "--allow-remote",
                             "--port", str(port)], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        warning = proc.stderr.readline()
        assert warning.startswith(f"pdbg: warning: serving on [::]:{port}, which is not loopback"), warning
    finally:
        interrupt(proc)


def test_stopping_the_server_ends_open_tabs_at_once() -> None:
    """Ctrl+C or SIGTERM with a tab open: the server's shutdown ends the tab's handler (which closes its
    websocket and quits its TUI), instead of aiohttp waiting out its shutdown timeout (~20 s a tab) first."""
    from tui.cmd_serve import _server_class

    ended: list[str] = []

    class Base:  # textual-serve's Server, as far as the subclass uses it: a tab's handler runs until cancelled
        async def handle_websocket(self, request: Any) -> str:
            try:
                await asyncio.Event().wait()
            finally:
                ended.append(request)
            return "closed"

        async def on_shutdown(self, app: Any) -> None:
            ended.append("base shutdown")

    async def scenario() -> list[Any]:
        server = _server_class(Base)()
        tabs = [asyncio.ensure_future(server.handle_websocket(f"tab {i}")) for i in range(2)]
        await asyncio.sleep(0)  # (both handlers start and wait on their websocket)
        await server.on_shutdown(None)
        return [tab.done() for tab in tabs]

    assert asyncio.run(scenario()) == [True, True]
    assert sorted(ended[:2]) == ["tab 0", "tab 1"] and ended[2:] == ["base shutdown"]
