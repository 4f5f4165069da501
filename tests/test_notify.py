"""study.notify: messages to a local HTTP endpoint through Apprise's json:// (a new best, the
study's end said once by one of two workers, failures in a row, a stall seen by `hpo status
--watch`), never in a trial's way (an endpoint that hangs), and the URL's secrets in no output
and not in the study database."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState, create_trial

from hpo.config.loader import parse_config
from hpo.config.notify import NotifyConfig
from hpo.errors import ConfigError
from hpo.notify import Notifier
from hpo.storage.url import mask_text
from hpo.study.notices import failure_streak, study_ended
from tests.conftest import exit_code, run_hpo, start_hpo, write_config

pytest.importorskip("apprise")

PASSWORD = "S3cretPassw0rd"
TOKEN = "T0kenValue99"


class Endpoint:
    """An HTTP server on 127.0.0.1 in a thread: keeps each JSON body POSTed to it, with its
    headers; `hang` makes it answer nothing until the test ends."""

    def __init__(self, hang: bool = False) -> None:
        self.messages: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.changed = threading.Condition()
        self.release = threading.Event()
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if hang:
                    endpoint.release.wait(120)
                with endpoint.changed:
                    endpoint.messages.append(json.loads(body or b"{}"))
                    endpoint.headers.append(dict(self.headers))
                    endpoint.changed.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str = "hook") -> str:
        return f"json://user:{PASSWORD}@127.0.0.1:{self.port}/{path}/?+X-Token={TOKEN}"

    def titles(self) -> list[str]:
        with self.changed:
            return [m.get("title", "") for m in self.messages]

    def wait_for(self, predicate: Callable[[list[str]], bool], timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not predicate([m.get("title", "") for m in self.messages]):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"messages never came; got {self.messages}")
                self.changed.wait(left)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(autouse=True)
def _forget_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The secrets a test's configs register stay in this test: masking lasts for the process,
    and this suite's endpoint (127.0.0.1) would otherwise be masked in every later test."""
    import hpo.storage.url

    monkeypatch.setattr(hpo.storage.url, "_REGISTERED", hpo.storage.url._REGISTERED)


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    served = Endpoint()
    yield served
    served.close()


@pytest.fixture
def hanging() -> Iterator[Endpoint]:
    served = Endpoint(hang=True)
    yield served
    served.close()


def study_config(tmp_path: Path, body: str, urls: list[str], **notify: Any) -> Path:
    (tmp_path / "train_fn.py").write_text(f"def train(ctx):\n{body}\n", encoding="utf-8")
    raw = {
        "training": {"entrypoint": "train_fn:train", "device": "cpu"},
        "study": {
            "metric": "loss",
            "direction": "minimize",
            "trial_isolation": "none",
            "n_trials": 4,
            "sampler": {"type": "random", "seed": 0},
            "notify": {"urls": urls, **notify},
        },
        "search_space": {"x": {"type": "float", "low": -1.0, "high": 1.0}},
    }
    return write_config(tmp_path / "c.yaml", raw)


def secret_free(*texts: str) -> None:
    for text in texts:
        assert PASSWORD not in text and TOKEN not in text, text


def test_two_workers_say_each_new_best_and_the_end_once_with_no_secret_anywhere(
    tmp_path: Path,
    endpoint: Endpoint,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = study_config(tmp_path, "    return ctx.params['x'] ** 2", [endpoint.url()])
    url = f"sqlite:///{tmp_path / 's.db'}"
    args = ("run", "--study", "s", "--config", str(config), "--storage", url, "--debug")
    workers = [start_hpo(*args, cwd=tmp_path) for _ in range(2)]
    outputs = [worker.communicate(timeout=300) for worker in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    # The workers wait for their last messages before they exit: all are here.
    titles = endpoint.titles()
    assert sum("has ended" in t for t in titles) == 1, titles
    study = optuna.load_study(study_name="s", storage=url)
    bests = [t for t in titles if "new best" in t]
    # Two workers send at once: the study's best was said, not necessarily last.
    assert any(f"loss={study.best_value:.4g}" in t for t in bests), titles
    # The endpoint got the secrets (they are the URL's, for the service)...
    assert all(h.get("X-Token") == TOKEN for h in endpoint.headers)
    # ...and nothing else did: not the workers' output, the database, or `hpo status`.
    # `hpo status` by main() in this process: what it prints, not how a process starts.
    capsys.readouterr()
    assert hpo_main(["status", "--study", "s", "--storage", url]) == 0
    assert hpo_main(["status", "--study", "s", "--storage", url, "--json"]) == 0
    status = capsys.readouterr()
    assert "complete" in status.out, status.out
    secret_free(*[text for pair in outputs for text in pair], status.out, status.err)
    # Every file the workers wrote: the database (its journal too), checkpoints, caches.
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "c.yaml"]
    assert tmp_path / "s.db" in written
    secret_free(*[p.read_bytes().decode("latin-1") for p in written])


def test_failures_in_a_row_are_said_once_per_streak(tmp_path: Path, endpoint: Endpoint) -> None:
    # The numbers in the reason differ from trial to trial: still one reason.
    body = "    raise ValueError(f\"out of memory: tried {abs(ctx.params['x']) * 100:.0f} MiB\")"
    config = study_config(tmp_path, body, [endpoint.url()], failures_in_a_row=2)
    url = f"sqlite:///{tmp_path / 'f.db'}"
    done = run_hpo("run", "--study", "f", "--config", str(config), "--storage", url, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    titles = endpoint.titles()
    failures = [m for m in endpoint.messages if "in a row failed" in m.get("title", "")]
    assert len(failures) == 1, titles
    assert "out of memory: tried" in failures[0]["message"]
    assert sum("has ended" in t for t in titles) == 1 and not any("new best" in t for t in titles)


def test_an_endpoint_that_hangs_costs_the_trials_nothing(tmp_path: Path, hanging: Endpoint) -> None:
    # Apprise would wait a minute for the answer (rto): the worker waits study.notify.wait.
    config = study_config(
        tmp_path, "    return ctx.params['x'] ** 2", [hanging.url() + "&rto=60"], wait=1
    )
    url = f"sqlite:///{tmp_path / 'h.db'}"
    started = time.monotonic()
    done = run_hpo("run", "--study", "h", "--config", str(config), "--storage", url, cwd=tmp_path)
    took_s = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    trials = optuna.load_study(study_name="h", storage=url).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    # Four new bests and an end, a minute each if sent in the trials' way.
    assert took_s < 45, took_s
    assert "not sent within study.notify.wait" in done.stderr
    secret_free(done.stdout, done.stderr)


def test_a_notifier_never_blocks_and_drops_what_a_full_queue_cannot_hold(
    hanging: Endpoint,
) -> None:
    config = NotifyConfig(urls=[hanging.url()], wait=0.2)
    notifier = Notifier(config, max_waiting=2)
    started = time.monotonic()
    for _ in range(5):
        notifier.submit(lambda: notifier.say("title", "body"))
    assert time.monotonic() - started < 0.5
    assert notifier.dropped >= 2
    notifier.close()
    assert time.monotonic() - started < 5


def test_a_watcher_says_a_stall(
    tmp_path: Path,
    endpoint: Endpoint,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"sqlite:///{tmp_path / 'w.db'}"
    study = optuna.create_study(study_name="w", storage=url)
    study.set_user_attr("n_trials", 5)
    study.enqueue_trial({"x": 0.5})  # a queued trial and no worker: nothing moves
    config = study_config(tmp_path, "    return 0.0", [endpoint.url()], stall_after=0.5)
    args = ("status", "--study", "w", "--storage", url, "--watch", "--interval", "0.2")
    watched = run_hpo(*args, "--notify", str(config), cwd=tmp_path, timeout=120)
    assert watched.returncode == 1, watched.stderr
    assert "has stopped moving" in watched.stderr
    endpoint.wait_for(lambda titles: any("has stalled" in t for t in titles), timeout_s=10)
    secret_free(watched.stdout, watched.stderr)
    alone = ["status", "--study", "w", "--storage", url, "--notify", str(config)]
    assert exit_code(hpo_main, alone) == 2
    assert "--notify goes with --watch" in capsys.readouterr().err


def test_a_bad_url_or_no_apprise_is_one_line_and_exit_2_with_secrets_masked(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    secret_url = f"json://user:{PASSWORD}@127.0.0.1:9/hook/?+X-Token={TOKEN}"
    bad = f"slack://{TOKEN}x/only-one-part"
    config = study_config(tmp_path, "    return 0.0", [secret_url, bad])
    url = f"sqlite:///{tmp_path / 'b.db'}"
    monkeypatch.chdir(tmp_path)  # train_fn.py, as `hpo run` started there finds it
    assert hpo_main(["run", "--study", "b", "--config", str(config), "--storage", url]) == 2
    done = capsys.readouterr()
    assert done.err.count("\n") == 1, done.err
    assert "study.notify.urls: got 'slack://****'; is not a URL Apprise can send to" in done.err
    secret_free(done.out, done.err)
    assert not (tmp_path / "b.db").exists()
    # Without apprise: one line naming the extra.
    import hpo.config.notify as notify_config

    monkeypatch.setattr(notify_config, "apprise_installed", lambda: False)
    raw = {
        "training": {"entrypoint": "train_fn:train"},
        "study": {"metric": "loss", "direction": "minimize", "notify": {"urls": [secret_url]}},
        "search_space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
    }
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, tmp_path)
    assert "pip install 'hpo[notify]'" in str(caught.value)
    assert str(caught.value).count("\n") == 0
    secret_free(str(caught.value))


def test_a_config_s_notify_secrets_are_masked_in_every_message_even_a_wrong_value(
    tmp_path: Path,
) -> None:
    raw = {
        "training": {"entrypoint": "train_fn:train"},
        "study": {
            "metric": "loss",
            "direction": "minimize",
            "notify": {"urls": [f"slack://{TOKEN}/B1234567/C7654321", 3]},
        },
        "search_space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
    }
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, tmp_path)
    assert "must be a list, each item a string" in str(caught.value)
    secret_free(str(caught.value))
    # From now on, in this process, a library's error that quotes the token is masked too.
    assert TOKEN not in mask_text(f"HTTPError: 403 for https://hooks.slack.com/{TOKEN}/x")


def test_what_the_trackers_are_sent_of_the_config_masks_the_notify_secrets(
    tmp_path: Path,
) -> None:
    from hpo.tracking import study_start

    slack = f"slack://{TOKEN}/B1234567/C7654321/#hpo"
    raw = {
        "training": {"entrypoint": "train_fn:train"},
        "study": {"metric": "loss", "direction": "minimize", "notify": {"urls": [slack]}},
        "search_space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
    }
    config = parse_config(raw, tmp_path)
    study = optuna.create_study(direction="minimize")
    sent = study_start(config, study)
    assert "slack://" in json.dumps(sent.config)
    secret_free(json.dumps(sent.config), repr(config))


class Heard:
    """Notices that run each job at once and keep what is said."""

    def __init__(self) -> None:
        self.said: list[str] = []
        self.lock = threading.Lock()

    def wants(self, event: str) -> bool:
        return True

    def submit(self, job: Callable[[], None]) -> None:
        job()

    def say(self, title: str, body: str) -> None:
        with self.lock:
            self.said.append(title)

    def close(self) -> None:
        pass


def test_of_many_workers_ending_at_once_one_says_the_end_and_again_after_more_trials(
    tmp_path: Path,
) -> None:
    from hpo.storage.engine import open_storage
    from hpo.storage.url import StorageURL
    from hpo.study.notices import StudyNotices

    storage = open_storage(StorageURL(f"sqlite:///{tmp_path / 'c.db'}", "test"))
    study = optuna.create_study(study_name="c", storage=storage)
    for value in (3.0, 1.0, 2.0):
        study.add_trial(create_trial(value=value))
    heard = Heard()
    workers = [StudyNotices(study, storage, heard, 3) for _ in range(8)]
    start = threading.Barrier(len(workers))

    def end(worker: StudyNotices) -> None:
        start.wait()
        worker.worker_done(3)

    threads = [threading.Thread(target=end, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert heard.said == ["hpo: study 'c' has ended"]
    workers[0].worker_done(3)
    assert len(heard.said) == 1
    # A larger budget, spent: the study ended again, with more trials.
    study.add_trial(create_trial(value=0.5))
    workers[1].worker_done(4)
    assert heard.said == ["hpo: study 'c' has ended"] * 2


def test_a_new_best_is_said_for_the_trial_that_sets_it_or_joins_the_pareto_front(
    tmp_path: Path,
) -> None:
    from hpo.storage.engine import open_storage
    from hpo.storage.url import StorageURL
    from hpo.study.notices import StudyNotices

    storage = open_storage(StorageURL(f"sqlite:///{tmp_path / 'b.db'}", "test"))
    one = optuna.create_study(study_name="one", storage=storage, direction="maximize")
    one.set_metric_names(["accuracy"])
    heard = Heard()
    notices = StudyNotices(one, storage, heard, 3)
    for value in (0.5, 0.4, 0.7, 0.7):
        one.add_trial(create_trial(value=value, params={}, distributions={}))
        notices.trial_ended(one.trials[-1], "complete")
    assert heard.said == [
        "hpo: study 'one': new best accuracy=0.5",
        "hpo: study 'one': new best accuracy=0.7",
    ]
    two = optuna.create_study(
        study_name="two", storage=storage, directions=["maximize", "minimize"]
    )
    heard = Heard()
    notices = StudyNotices(two, storage, heard, 3)
    for values in ([0.5, 2.0], [0.4, 3.0], [0.3, 1.0]):  # the second is dominated
        two.add_trial(create_trial(values=values))
        notices.trial_ended(two.trials[-1], "complete")
    assert heard.said == [
        "hpo: study 'two': trial 0 joins the Pareto front",
        "hpo: study 'two': trial 2 joins the Pareto front",
    ]


def _finished(state: TrialState, reason: str | None = None, value: float = 1.0) -> Any:
    attrs = {"fail_reason": reason} if reason else {}
    return create_trial(
        state=state, value=value if state == TrialState.COMPLETE else None, user_attrs=attrs
    )


def test_a_failure_streak_is_the_last_failures_of_one_reason_numbers_aside() -> None:
    ok = _finished(TrialState.COMPLETE)
    oom = [_finished(TrialState.FAIL, f"OutOfMemoryError: tried {n} MiB") for n in (20, 24, 30)]
    nan = _finished(TrialState.FAIL, "the trial's value is NaN")
    assert failure_streak([ok, *oom]) == oom
    assert failure_streak([*oom, nan]) == [nan]
    # In the order they ended, not as listed: a success after the failures ends the streak.
    assert failure_streak([*oom, _finished(TrialState.COMPLETE)]) == []
    assert failure_streak([oom[1], ok, oom[0]]) == [oom[0], oom[1]]


def test_a_study_ends_when_nothing_runs_and_its_budget_is_spent() -> None:
    done = [_finished(TrialState.COMPLETE) for _ in range(3)]
    running = create_trial(state=TrialState.RUNNING)
    waiting = create_trial(state=TrialState.WAITING)
    assert study_ended(done, 3) and not study_ended(done, 4)
    assert not study_ended([*done, running], 3)
    assert study_ended([*done, waiting], 3)  # queued past the budget: waits for a larger one
    assert study_ended(done, None) and not study_ended([*done, waiting], None)
