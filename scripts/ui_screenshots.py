"""Screenshots of the MLflow UI on a small real fedcli store, taken in headless Chromium.

    .venv/bin/python scripts/ui_screenshots.py                      # docs/screenshots/*.png (FEMNIST)
    .venv/bin/python scripts/ui_screenshots.py --task lsq --rounds 2 --out /tmp/shots

It makes the store the way a user would (a short `fedcli train` and a two-trial `fedcli sweep`,
so that a sweep parent run with nested children exists), starts the UI with `fedcli ui` (which
prints the runs-table URL once the server answers /health) and photographs six pages:

    first-visit.png            the URL `fedcli ui` printed, in a new browser: fedcli's saved view
                               (tracking/mlflow/view.py), MLflow's shared-view banner, and the
                               Assistant panel MLflow opens by itself on a first visit
    first-visit-mlflow-defaults.png  the same runs table without the view, in a new browser:
                               MLflow's own default columns (no metric, no param)
    runs-table.png   the URL `fedcli ui` printed, once the Assistant panel is closed
    run-page.png     one run: its metrics, params (the resolved config) and fedcli.* tags
    metric-chart.png one metric by round for the sweep's trials (MLflow's metric page)
    sweep.png        the sweep: its parent run expanded over the nested trial runs

Why the DevTools protocol and not `chromium --headless=new --screenshot=URL`: the one-shot
screenshot is taken after a guessed `--virtual-time-budget`, and the last four shots need
per-browser state in localStorage that a view cannot carry: the Assistant panel closed, the
sweep's parent run expanded and, on the pages a view does not reach (the sweep's experiment),
the columns. So Chromium is driven over `--remote-debugging-pipe` (stdlib only: JSON messages
on file descriptors 3 and 4): a script seeds that state before MLflow's code runs, each shot
waits until the run names are on the page, and the page's DOM and text come back with the PNG
for tests/ui/test_mlflow_ui.py. The state seeded is only what a user sets with a few clicks
(the Assistant's x, Columns, the parent's expander); the two first-visit shots seed nothing.

Every URL carries `workflowType=machine_learning`: without it MLflow 3 shows run pages and the
metric page in its GenAI layout ("Evaluation runs", "Judges", "Prompts" in the sidebar).
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FEDCLI = [sys.executable, "-m", "fedcli"]
WIDTH, HEIGHT = 1600, 1000
ML = "workflowType=machine_learning"  # MLflow 3's model-training layout, not its GenAI one


def chromium_binary() -> str | None:
    """The Chromium (or Chrome) executable: $CHROMIUM, else the first of the usual names on PATH."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


# ----------------------------------------------------------------------------- the store


@dataclass(frozen=True)
class StorePlan:
    """What to train: one run in `experiment`, and a two-trial sweep in `sweep_experiment`."""

    task: str = "femnist"
    rounds: int = 15
    sweep_rounds: int = 8
    experiment: str = "femnist-demo"
    sweep_experiment: str = "femnist-sweep"
    run_name: str = "fedpa-femnist-demo"

    @property
    def metric(self) -> str:
        return "eval/dist_to_opt" if self.task == "lsq" else "eval/accuracy"


def plan_for(task: str, rounds: int | None) -> StorePlan:
    if task == "femnist":
        return StorePlan(rounds=rounds or 15, sweep_rounds=min(rounds or 8, 8))
    return StorePlan(task=task, rounds=rounds or 5, sweep_rounds=min(rounds or 3, 3), experiment=f"{task}-demo",
                     sweep_experiment=f"{task}-sweep", run_name=f"fedavg-{task}-demo")


def fedcli(*args: str, timeout: float = 3600) -> str:
    """Run `fedcli ARGS` (quiet) and return its stdout; raise with its stderr if it fails."""
    proc = subprocess.run([*FEDCLI, "-q", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"fedcli {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def make_store(root: Path, plan: StorePlan) -> None:
    """Train one run and sweep two algorithms under `root` (SQL store and MLflow store there)."""
    if plan.task == "femnist":  # the `make demo` run, shortened
        train = ["--config", str(REPO / "examples" / "fedpa-femnist-demo.yaml"), "--hp", "burn_in_rounds=5"]
        grid = {"algo": ["fedavg", "fedpa"]}
        base: dict[str, Any] = {"task": "femnist", "rounds": plan.sweep_rounds, "local_epochs": 2, "client_lr": 0.05,
                                "client_momentum": 0.9, "server_opt": "momentum", "server_lr": 0.5,
                                "hp.burn_in_rounds": 2}
    else:
        train, grid = ["--task", plan.task], {"algo": ["fedavg", "scaffold"]}
        base = {"task": plan.task, "rounds": plan.sweep_rounds}
    fedcli("train", *train, "--rounds", str(plan.rounds), "--root", str(root), "--experiment", plan.experiment,
           "--run-name", plan.run_name)
    spec = root / "sweep.yaml"
    spec.write_text(json.dumps({"experiment": plan.sweep_experiment, "base": base, "grid": grid, "seeds": [0]}))
    fedcli("sweep", str(spec), "--root", str(root))


# ----------------------------------------------------------------------------- the UI


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def fedcli_ui(root: Path, experiment: str, timeout_s: float = 240) -> Iterator[str]:
    """Run `fedcli ui` on `root` and yield the runs URL it prints once /health answers; stop it after."""
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([*FEDCLI, "ui", "--root", str(root), "--port", str(port), "--experiment", experiment],
                            stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        url = _first_line(proc, timeout_s)
        if not url.startswith("http://"):
            log.seek(0)
            raise RuntimeError(f"fedcli ui printed {url!r}, not a URL; its stderr:\n{log.read().decode()[-3000:]}")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)  # fedcli ui stops the server's whole process group
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _first_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            raise RuntimeError(f"fedcli ui printed no URL within {timeout_s:.0f} s")
    return proc.stdout.readline().strip()


def mlflow_api(base: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """GET (or POST `body` to) the MLflow REST API of the server at `base`."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{base}/api/2.0/mlflow/{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - loopback http
        return json.load(response)


def experiment_runs(base: str, name: str) -> tuple[str, list[dict[str, Any]]]:
    """The MLflow id of experiment `name` and its runs (`run_id`, `run_name`, `parent`), oldest first."""
    query = urllib.parse.urlencode({"experiment_name": name})
    experiment_id = mlflow_api(base, f"experiments/get-by-name?{query}")["experiment"]["experiment_id"]
    found = mlflow_api(base, "runs/search", {"experiment_ids": [experiment_id], "max_results": 100,
                                             "order_by": ["attributes.start_time ASC"]})
    runs = []
    for run in found.get("runs", []):
        tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
        runs.append({"run_id": run["info"]["run_id"], "run_name": run["info"]["run_name"],
                     "parent": tags.get("mlflow.parentRunId")})
    return experiment_id, runs


# ----------------------------------------------------------------------------- Chromium


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (fds 3 and 4, NUL-separated JSON)."""

    def __init__(self, binary: str, width: int = WIDTH, height: int = HEIGHT) -> None:
        self.profile = tempfile.mkdtemp(prefix="fedcli-chromium-")
        self.log = tempfile.TemporaryFile()
        child_in, self._out = os.pipe()
        self._in, child_out = os.pipe()
        child_in, child_out = _above_4(child_in), _above_4(child_out)  # so that dup2 onto 3 and 4 clobbers neither
        args = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
                "--no-default-browser-check", "--mute-audio", f"--user-data-dir={self.profile}",
                f"--window-size={width},{height}", "--remote-debugging-pipe", "about:blank"]

        def onto_3_and_4() -> None:  # in the child: DevTools reads fd 3 and writes fd 4
            os.dup2(child_in, 3)
            os.dup2(child_out, 4)

        self.proc = subprocess.Popen(args, preexec_fn=onto_3_and_4, close_fds=False, stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=self.log)
        os.close(child_in)
        os.close(child_out)
        self._buffer, self._id = b"", 0
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False}, session=True)

    def call(self, method: str, params: dict[str, Any] | None = None, session: bool = False) -> Any:
        """Send one command and return its result (events that arrive meanwhile are dropped)."""
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self.session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._in, 1 << 20)
                if not chunk:
                    self.log.seek(0)
                    raise RuntimeError(f"Chromium closed its DevTools pipe during {method} (exit code "
                                       f"{self.proc.poll()}); its output:\n{self.log.read().decode()[-3000:]}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=True)
        return result.get("result", {}).get("value")

    def before_each_page(self, script: str) -> None:
        """Run `script` in every page this tab loads, before the page's own scripts."""
        self.call("Page.addScriptToEvaluateOnNewDocument", {"source": script}, session=True)

    def open(self, url: str, wait_for: list[str], selector: str = "body", timeout_s: float = 90) -> str:
        """Load `url` and wait until the page's text holds every string of `wait_for` and
        `selector` matches; then let it settle (charts animate) and return the text."""
        self.call("Page.navigate", {"url": "about:blank"}, session=True)  # a hash change alone reloads nothing
        self.call("Page.navigate", {"url": url}, session=True)
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            text = self.evaluate("document.body ? document.body.innerText : ''") or ""
            if all(w in text for w in wait_for) and self.evaluate(f"!!document.querySelector({selector!r})"):
                time.sleep(2.0)
                return self.evaluate("document.body.innerText") or ""
            time.sleep(0.5)
        missing = [w for w in wait_for if w not in text]
        raise RuntimeError(f"{url} did not show {missing} (or {selector!r}) within {timeout_s:.0f} s; "
                           f"its text begins: {text[:500]!r}")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"]
        path.write_bytes(base64.b64decode(data))

    def dom(self) -> str:
        return self.evaluate("document.documentElement.outerHTML") or ""

    def close(self) -> None:
        try:
            self.call("Browser.close")
            self.proc.wait(timeout=20)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            os.close(self._in)
            os.close(self._out)
            self.log.close()
            shutil.rmtree(self.profile, ignore_errors=True)


def _above_4(fd: int) -> int:
    """`fd` moved to a number >= 10 (non-inheritable, as os.pipe made it)."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


def seed_state(ui_states: dict[str, dict[str, Any]]) -> str:
    """JavaScript that sets MLflow's per-browser UI state: the Assistant panel not opened on the
    first visit, and per experiment id the runs table's columns and expanded parent runs."""
    from fedcli.tracking.mlflow.view import page_state

    items = {"mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true"}
    for experiment_id, state in ui_states.items():
        key = f"MLflowLocalStorage-1.1-ExperimentPage-{json.dumps([experiment_id])}-ReactComponentState"
        items[key] = json.dumps(page_state(**state))
    return f"try {{ for (const [k, v] of Object.entries({json.dumps(items)})) localStorage.setItem(k, v); }} catch (e) {{}}"


def metric_url(base: str, experiment_id: str, run_ids: list[str], metric: str) -> str:
    """MLflow's metric page (`Routes.getMetricPageRoute`): `metric` by step for `run_ids`."""
    def js(value: Any) -> str:
        return urllib.parse.quote(json.dumps(value, separators=(",", ":")))
    return (f"{base}/#/metric?runs={js(run_ids)}&metric={js(metric)}&experiments={js([experiment_id])}"
            f"&plot_metric_keys={js([metric])}&plot_layout=%7B%7D&x_axis=step&y_axis_scale=linear"
            f"&line_smoothness=1&show_point=true&deselected_curves=%5B%5D&last_linear_y_axis_range=%5B%5D&{ML}")


# ----------------------------------------------------------------------------- the shots


@dataclass(frozen=True)
class Shot:
    """One page photographed: where it was, the PNG, and the page's text and DOM at that moment."""

    name: str
    url: str
    png: Path
    text: str
    dom: str


def take_screenshots(root: Path, plan: StorePlan, out: Path, binary: str) -> dict[str, Shot]:
    """Start `fedcli ui` on `root` and photograph the six pages into `out`."""
    with fedcli_ui(root, plan.experiment) as table_url:
        return photograph(table_url, plan, out, binary)


def photograph(table_url: str, plan: StorePlan, out: Path, binary: str) -> dict[str, Shot]:
    """Photograph the six pages of the UI whose runs table `fedcli ui` printed as `table_url`."""
    out.mkdir(parents=True, exist_ok=True)
    base = table_url.split("/#/", 1)[0]
    demo_id, demo_runs = experiment_runs(base, plan.experiment)
    sweep_id, sweep_runs = experiment_runs(base, plan.sweep_experiment)
    parent = next(r for r in sweep_runs if r["parent"] is None)
    trials = [r for r in sweep_runs if r["parent"] == parent["run_id"]]
    demo = next(r for r in demo_runs if r["run_name"] == plan.run_name)
    columns = [f"metrics.`{plan.metric}`", "metrics.`train/loss`", "params.`algorithm.name`",
               "params.`train.rounds`", "params.`data.task`"]
    grid = "[role=grid], .ag-root"
    table = ([plan.run_name, "Runs"], grid)
    shots = {}
    for name, url in (("first-visit", table_url),  # each in a new browser, nothing seeded
                      ("first-visit-mlflow-defaults", table_url.split("&viewStateShareKey=")[0])):
        browser = Chromium(binary)
        try:
            shots[name] = _shot(browser, name, url, *table, out)
        finally:
            browser.close()
    pages = [
        ("runs-table", table_url, *table),
        ("run-page", f"{base}/#/experiments/{demo_id}/runs/{demo['run_id']}?{ML}",
         [plan.run_name, "Parameters", plan.metric], "body"),
        ("metric-chart", metric_url(base, sweep_id, [t["run_id"] for t in trials], plan.metric),
         [plan.metric, *(t["run_name"] for t in trials)], "svg .scatterlayer"),
        ("sweep", f"{base}/#/experiments/{sweep_id}?{ML}", [parent["run_name"], *(t["run_name"] for t in trials)],
         grid),
    ]
    browser = Chromium(binary)
    try:  # the Assistant closed; the sweep's experiment (no saved view there) with columns and its parent expanded
        browser.before_each_page(seed_state({sweep_id: {"columns": columns, "expanded": [parent["run_id"]]}}))
        for name, url, wait_for, selector in pages:
            shots[name] = _shot(browser, name, url, wait_for, selector, out)
    finally:
        browser.close()
    return shots


def _shot(browser: Chromium, name: str, url: str, wait_for: list[str], selector: str, out: Path) -> Shot:
    text = browser.open(url, wait_for, selector)
    png = out / f"{name}.png"
    browser.screenshot(png)
    return Shot(name, url, png, text, browser.dom())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "screenshots", help="folder of the PNGs")
    parser.add_argument("--root", type=Path, help="fedcli root to fill and show [default: a temporary folder]")
    parser.add_argument("--task", default="femnist", help="femnist (the demo) or a fast synthetic task (lsq)")
    parser.add_argument("--rounds", type=int, help="rounds of the single run [default: 15 femnist, 5 otherwise]")
    parser.add_argument("--reuse", action="store_true", help="photograph --root as it is (train nothing)")
    parser.add_argument("--save-dom", action="store_true", help="also write each page's DOM as NAME.html")
    args = parser.parse_args(argv)
    binary = chromium_binary()
    if binary is None:
        print("error: no Chromium found (apt-get install chromium, or set CHROMIUM=/path/to/chrome)", file=sys.stderr)
        return 2
    plan = plan_for(args.task, args.rounds)
    with tempfile.TemporaryDirectory(prefix="fedcli-ui-") as scratch:
        root = (args.root or Path(scratch) / "runs").resolve()
        if not args.reuse:
            started = time.monotonic()
            make_store(root, plan)
            print(f"store: {root} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
        for shot in take_screenshots(root, plan, args.out, binary).values():
            if args.save_dom:
                shot.png.with_suffix(".html").write_text(shot.dom)
            print(f"{shot.png}  <- {shot.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
