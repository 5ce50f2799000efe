"""A headless Chromium that opens a page as a person would: for the page tests (tests/browser.py)
and bench_report_page.py's `--render`.

It speaks the DevTools protocol over `--remote-debugging-pipe` (fd 3: commands in, fd 4:
replies and events out, each message JSON ended by a NUL byte), so it needs nothing beyond the
standard library and the Debian `chromium` package. `open_page` returns the text a person sees
(`document.body.innerText`: folded <details> content and hidden elements excluded), every console
message, uncaught exception and log entry, every network request, and a full-page screenshot.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

_TRAMPOLINE = (
    "import os, sys; r, w = int(sys.argv[1]), int(sys.argv[2]); os.dup2(r, 3); os.dup2(w, 4); "
    "os.close(r); os.close(w); os.execv(sys.argv[3], sys.argv[3:])"
)
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
TIMEOUT_S = 120.0


def find_chromium() -> str | None:
    """The browser binary: $GRAPHSAN_CHROMIUM, else the first of CANDIDATES on PATH."""
    env = os.environ.get("GRAPHSAN_CHROMIUM")
    if env:
        return env if os.path.exists(env) else None
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class Page:
    text: str  # what is rendered, as innerText
    dom: str  # the DOM after scripts ran
    console: list[str] = field(default_factory=list)  # "level: text"
    errors: list[str] = field(default_factory=list)  # console errors, exceptions, error logs
    requests: list[str] = field(default_factory=list)  # every URL the page asked for
    scripts_ran: bool = False
    values: dict = field(default_factory=dict)  # what each probe expression gave, by name
    # seconds: "load" from navigation to the load event, "layout" for the whole page's layout
    # after it, "screenshot" for the full-page screenshot (where one was asked for)
    timings: dict = field(default_factory=dict)


class DevToolsError(RuntimeError):
    pass


class _Pipe:
    def __init__(self, binary: str, profile: str, timeout: float = TIMEOUT_S) -> None:
        self.timeout = timeout
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()
        # the child's ends go above 4, and a small trampoline places them at 3 and 4 before it
        # execs the browser (subprocess keeps only the descriptors it is given, by number)
        child_r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10)
        child_w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        args = [
            sys.executable,
            "-c",
            _TRAMPOLINE,
            str(child_r),
            str(child_w),
            binary,
            "--headless",
            "--no-sandbox",  # root in containers
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--hide-scrollbars",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            pass_fds=(child_r, child_w),
        )
        os.close(child_r)
        os.close(child_w)
        self._buf = b""
        self._next = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._next += 1
        msg = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise DevToolsError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str) -> dict:
        for i, ev in enumerate(self.events):
            if ev.get("method") == method:
                return self.events.pop(i)
        deadline = time.monotonic() + self.timeout
        while True:
            ev = self._read(deadline)
            if ev.get("method") == method:
                return ev
            self.events.append(ev)

    def _read(self, deadline: float | None = None) -> dict:
        deadline = deadline or time.monotonic() + self.timeout
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise DevToolsError("no answer from the browser in time")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                err = self.proc.stderr.read().decode(errors="replace")[-2000:]
                raise DevToolsError(f"the browser exited: {err}")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def close(self) -> None:
        with contextlib.suppress(DevToolsError, OSError):
            self.send("Browser.close")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._r, self._w):
            os.close(fd)
        if self.proc.stderr:
            self.proc.stderr.close()


def open_page(
    binary: str,
    path: str,
    screenshot: str | None = None,
    width: int = 1280,
    probes: dict[str, str] | None = None,
    timeout: float = TIMEOUT_S,
    whole: bool = True,
) -> Page:
    """Open `path` from disk, let it load and run its scripts, and read what it shows;
    `probes` are JavaScript expressions (by name) evaluated in the loaded page, their values
    (JSON-able) kept in `Page.values`; `timeout`: seconds any one step may take; `whole`: the
    screenshot holds the whole page (up to 16,000 px), else the first screen."""
    profile = tempfile.mkdtemp(prefix="graphsan-chromium-")
    pipe = _Pipe(binary, profile, timeout)
    try:
        target = pipe.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        for domain in ("Runtime", "Log", "Page", "Network"):
            pipe.send(f"{domain}.enable", session=session)
        metrics = {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False}
        pipe.send("Emulation.setDeviceMetricsOverride", metrics, session=session)
        start = time.perf_counter()
        pipe.send("Page.navigate", {"url": "file://" + os.path.abspath(path)}, session=session)
        pipe.wait_event("Page.loadEventFired")
        timings = {"load": time.perf_counter() - start}

        def evaluate(expr: str):
            res = pipe.send(
                "Runtime.evaluate", {"expression": expr, "returnByValue": True}, session=session
            )
            if "exceptionDetails" in res:  # a probe with a mistake fails here, not as a None
                raise DevToolsError(f"{expr[:80]}: {res['exceptionDetails'].get('text')}")
            return res.get("result", {}).get("value")

        start = time.perf_counter()
        evaluate("document.documentElement.scrollHeight")  # lays the whole page out
        timings["layout"] = time.perf_counter() - start
        page = Page(
            timings=timings,
            text=evaluate("document.body.innerText") or "",
            dom=evaluate("document.documentElement.outerHTML") or "",
            scripts_ran=evaluate("document.documentElement.dataset.scripts") == "ran",
        )
        page.values = {name: evaluate(expr) for name, expr in (probes or {}).items()}
        if screenshot:
            start = time.perf_counter()
            if whole:
                size = pipe.send("Page.getLayoutMetrics", session=session)["cssContentSize"]
                height = min(int(size["height"]) + 1, 16000)
                pipe.send(
                    "Emulation.setDeviceMetricsOverride",
                    metrics | {"height": height},
                    session=session,
                )
            shot = pipe.send(
                "Page.captureScreenshot",
                {"format": "png", "captureBeyondViewport": whole},
                session=session,
            )
            with open(screenshot, "wb") as fh:
                fh.write(base64.b64decode(shot["data"]))
            timings["screenshot"] = time.perf_counter() - start
        for ev in pipe.events:
            _collect(ev, page)
        return page
    finally:
        pipe.close()
        shutil.rmtree(profile, ignore_errors=True)


def _collect(ev: dict, page: Page) -> None:
    method, params = ev.get("method"), ev.get("params", {})
    if method == "Runtime.consoleAPICalled":
        text = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
        page.console.append(f"{params.get('type')}: {text}")
        if params.get("type") in ("error", "assert"):
            page.errors.append(f"console.{params['type']}: {text}")
    elif method == "Runtime.exceptionThrown":
        details = params.get("exceptionDetails", {})
        desc = details.get("exception", {}).get("description") or details.get("text")
        page.errors.append(f"uncaught: {desc}")
    elif method == "Log.entryAdded":
        entry = params.get("entry", {})
        page.console.append(f"log {entry.get('level')}: {entry.get('text')}")
        if entry.get("level") == "error":
            page.errors.append(f"log: {entry.get('text')} ({entry.get('url', '')})")
    elif method == "Network.requestWillBeSent":
        page.requests.append(params.get("request", {}).get("url", ""))
