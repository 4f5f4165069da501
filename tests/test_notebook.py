"""examples/notebook.ipynb executed by a real Jupyter kernel (nbclient and ipykernel, the
kernel being this venv's Python): a training function defined in a cell tuned with trial
processes, the progress shown in one display updated in place, the result and the report
displayed inline, a second run that says the budget is spent, and a kernel interrupt while a
trial is held at a known point: the trial handed back, the kernel alive after.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "examples" / "notebook.ipynb"
KERNEL = "hpo-test-venv"

RERUN = """
again = hpo.run(config, study="notebook", storage="sqlite:///notebook.db", entrypoint=train)
print("again ran", again.trials_run)
"""

# A training function that holds, once it has started in its trial process, until that process
# is asked to stop: the test interrupts the kernel while it holds. `held` is a global of the
# notebook's, sent with the function.
HOLDING = """
import os, pathlib, time

held = pathlib.Path({held!r})

def hold(ctx):
    (held / str(os.getpid())).write_text("held")
    deadline = time.monotonic() + 120
    while not ctx.should_stop and time.monotonic() < deadline:
        time.sleep(0.02)
    return {{"loss": 1.0}}

interrupted = hpo.run(config, study="held", storage="sqlite:///notebook.db", entrypoint=hold)
print("stopped by", interrupted.stopped_by)
"""

AFTER = """
states = sorted(t.state for t in hpo.open_study("held", storage="sqlite:///notebook.db").trials())
print("held states", states)
"""


class RecordingClient(NotebookClient):
    """nbclient's client, keeping every message the kernel sent (the display's updates)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.messages: list[dict[str, Any]] = []

    def process_message(self, msg: dict[str, Any], cell: Any, cell_index: int) -> Any:
        self.messages.append(msg)
        return super().process_message(msg, cell, cell_index)


def _venv_kernel(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernelspec of this very Python, first on JUPYTER_PATH: a `python3` spec installed
    elsewhere (the user's, the system's) may name another interpreter."""
    spec = folder / "kernels" / KERNEL
    spec.mkdir(parents=True)
    kernel = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "hpo test venv",
        "language": "python",
        "env": {"PYTHONPATH": str(REPO)},
    }
    (spec / "kernel.json").write_text(json.dumps(kernel), encoding="utf-8")
    monkeypatch.setenv("JUPYTER_PATH", str(folder))


def _interrupt_when_held(client: NotebookClient, held: Path, done: threading.Event) -> None:
    """The kernel interrupted (as Kernel > Interrupt does) once a trial process holds."""
    deadline = time.monotonic() + 120
    while not any(held.iterdir()):
        if done.is_set() or time.monotonic() > deadline:
            return  # the cell ended without holding: its output says why
        time.sleep(0.05)
    asyncio.run(client.km.interrupt_kernel())


def _text(cell: Any) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        elif "data" in output:
            parts.extend(str(value) for value in output.data.values())
        elif output.output_type == "error":
            parts.append("\n".join(output.traceback))
    return "\n".join(parts)


@pytest.mark.slow
def test_notebook_runs_with_a_real_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _venv_kernel(tmp_path / "jupyter", monkeypatch)
    work = tmp_path / "work"
    work.mkdir()
    held = tmp_path / "held"
    held.mkdir()
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    example_cells = len(notebook.cells)
    notebook.cells += [
        new_code_cell(RERUN),
        new_code_cell(HOLDING.format(held=str(held))),
        new_code_cell(AFTER),
    ]
    client = RecordingClient(
        notebook, timeout=180, kernel_name=KERNEL, resources={"metadata": {"path": str(work)}}
    )
    done = threading.Event()
    with client.setup_kernel():
        for index, cell in enumerate(notebook.cells[:-2]):
            client.execute_cell(cell, index)
        interrupter = threading.Thread(target=_interrupt_when_held, args=(client, held, done))
        interrupter.start()
        try:
            client.execute_cell(notebook.cells[-2], len(notebook.cells) - 2)
        finally:
            done.set()
            interrupter.join()
        client.execute_cell(notebook.cells[-1], len(notebook.cells) - 1)

    run_cell = next(c for c in notebook.cells if "hpo.run(config" in c.source)
    shown = _text(run_cell)
    assert "hpo: ran 2 trial(s)" in shown, shown
    assert "hpo: best trial #" in shown, shown
    assert "<table>" in shown  # the result's _repr_html_
    # One display, updated in place: the progress, then the summary; no terminal codes.
    displays = [o for o in run_cell.outputs if o.output_type == "display_data"]
    assert len(displays) == 1, run_cell.outputs
    shows = [m for m in client.messages if m["msg_type"].endswith("display_data")]
    assert any("trial #" in m["content"]["data"]["text/plain"] for m in shows), shows
    assert any(m["msg_type"] == "update_display_data" for m in shows), shows
    assert all("\x1b[" not in _text(cell) for cell in notebook.cells)

    report_cell = notebook.cells[example_cells - 1]
    report = [o for o in report_cell.outputs if o.output_type == "execute_result"]
    assert report and "text/markdown" in report[0].data, report_cell.outputs
    assert "notebook" in report[0].data["text/markdown"]

    rerun = _text(notebook.cells[-3])
    assert "again ran 0" in rerun and "budget (n_trials=2) is spent" in rerun, rerun

    interrupted = _text(notebook.cells[-2])
    assert any(held.iterdir()), interrupted  # the function ran in its trial process
    assert "stopped by SIGINT" in interrupted, interrupted
    assert "KeyboardInterrupt" not in interrupted, interrupted
    # Handed back: recorded as failed and queued again, for a later run to resume.
    after = _text(notebook.cells[-1])
    assert "held states ['fail', 'waiting']" in after, after


def test_a_second_interrupt_in_a_kernel_does_not_end_it(caplog: pytest.LogCaptureFixture) -> None:
    """In a terminal a second Ctrl-C exits at once; in a notebook's kernel that would end the
    user's session: there it is said and the stop goes on."""
    import signal

    from hpo.stopping import StopRequest

    stop = StopRequest()
    stop.exit_on_second = False
    stop.handler(signal.SIGINT, None)
    stop.handler(signal.SIGINT, None)  # os._exit here would end pytest itself
    assert stop.signal_name == "SIGINT"
    assert "SIGINT again: still stopping the running trial" in caplog.text
