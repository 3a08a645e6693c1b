"""Console hygiene: no colour codes in what is not a terminal, log lines follow a redirected stderr, Ray's actor
prefixes uncoloured when the driver's output is a file."""

import io
import logging
import sys

from marin_rl.logs import PlainFormatter, StderrHandler, is_terminal, plain_ray_output, strip_ansi

RED, RESET = "\x1b[31m", "\x1b[0m"


class _Tty(io.StringIO):
    def isatty(self):
        return True


def _record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("marin_rl", logging.INFO, __file__, 1, msg, None, None)


def test_the_formatter_strips_colour_codes_unless_it_writes_to_a_terminal():
    msg = f"{RED}(LearnerActor pid=1){RESET} warm start \x1b[1;32mdone\x1b[0m"
    plain = PlainFormatter(color=False).format(_record(msg))
    assert "\x1b" not in plain and plain.endswith("marin_rl INFO (LearnerActor pid=1) warm start done")
    assert PlainFormatter(color=True).format(_record(msg)).endswith(msg)
    assert strip_ansi("a\x1b[2K\x1b[1Ab") == "ab"  # cursor moves too
    assert not is_terminal(io.StringIO()) and is_terminal(_Tty()) and not is_terminal(None)


def test_the_handler_writes_to_the_stderr_of_the_moment(monkeypatch):
    handler = StderrHandler()
    handler.setFormatter(PlainFormatter("%(message)s"))
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    handler.emit(_record("one"))
    monkeypatch.setattr(sys, "stderr", second)  # e.g. a live progress display redirecting stderr
    handler.emit(_record("two"))
    assert first.getvalue() == "one\n" and second.getvalue() == "two\n"


def test_ray_prints_actor_lines_without_colour_when_the_driver_writes_to_a_file(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", _Tty())
    env: dict[str, str] = {}
    plain_ray_output(env)
    assert env == {"RAY_COLOR_PREFIX": "0"}
    env = {"RAY_COLOR_PREFIX": "1"}
    plain_ray_output(env)
    assert env == {"RAY_COLOR_PREFIX": "1"}  # the user's choice wins
    monkeypatch.setattr(sys, "stdout", _Tty())
    env = {}
    plain_ray_output(env)
    assert env == {}  # a terminal: Ray's colours are welcome


def test_dropped_messages_are_dropped_once_configured_and_others_pass(caplog):
    from marin_rl.logs import drop_log_messages

    name = "marin_rl.test_drop"
    drop_log_messages(name, "Token authentication is enabled")
    drop_log_messages(name, "Token authentication is enabled")  # idempotent
    assert len(logging.getLogger(name).filters) == 1
    with caplog.at_level(logging.INFO, logger=name):
        logging.getLogger(name).warning("Token authentication is enabled for this Ray cluster. Set ...")
        logging.getLogger(name).warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]
