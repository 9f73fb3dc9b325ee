"""`leat run` in a pseudo-terminal, as a person types at it: the up arrow recalls the previous message (also in the
next session, from LEAT_HOME/history), Ctrl-C clears the line without ending the chat, `exit` quits."""

from __future__ import annotations

import os
import pty
import select
import signal
import sys
import time

import pytest
from leat.testing import write_tiny_gguf

llama = pytest.importorskip("leat_arch_llama.llama")
pytest.importorskip("leat_backend_cpu")

UP = "\x1b[A"


class Terminal:
    """A process on the far side of a pseudo-terminal, read until an expected text appears."""

    def __init__(self, args: list[str], env: dict[str, str]):
        # pty.fork makes the terminal the child's controlling terminal, so Ctrl-C there is a SIGINT as in a shell
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            # as a shell starts a command: Ctrl-C's SIGINT at its default, whatever the test process had made of it
            # (an ignored SIGINT is inherited through exec, and Python then installs no KeyboardInterrupt handler)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(args[0], args, env)
        self.seen = ""

    def expect(self, text: str, timeout: float = 60) -> str:
        """Everything read up to and including the next ``text``."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"no {text!r} within {timeout} s; the terminal shows:\n{self.seen}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    self.seen += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:  # the process is gone
                    break
        assert text in self.seen, f"no {text!r}; the terminal shows:\n{self.seen}"
        before, _, self.seen = self.seen.partition(text)
        return before + text

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def close(self, timeout: float = 30) -> int:
        """The exit status, once the process ends."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:  # drain what it prints, so it never blocks on a full terminal
                if select.select([self.fd], [], [], 0.1)[0]:
                    os.read(self.fd, 4096)
            except OSError:
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        raise AssertionError(f"leat run did not exit within {timeout} s")

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


@pytest.fixture
def chat(tmp_path, leat_home):
    model = write_tiny_gguf(llama.Llama, tmp_path / "tiny.gguf")
    env = {**os.environ, "LEAT_HOME": str(leat_home(tmp_path / "home")), "TERM": "xterm"}
    args = [sys.executable, "-m", "leat", "run", str(model), "--backend", "cpu", "-n", "2", "--temp", "0"]
    opened = []

    def start() -> Terminal:
        opened.append(Terminal(args, env))
        return opened[-1]

    yield start
    for terminal in opened:
        terminal.kill()


def test_up_arrow_recalls_the_previous_message_in_this_and_the_next_session(chat, tmp_path):
    term = chat()
    term.expect(">>> ")
    term.send("/system be brief\r")
    term.expect("system message set")
    term.expect(">>> ")
    term.send("/reset\r")
    term.expect("conversation cleared")
    term.expect(">>> ")
    # two presses go back past /reset to /system: Enter sends the recalled line again
    term.send(UP + UP + "\r")
    assert "system message set" in term.expect(">>> ")
    term.send("exit\r")
    assert term.close() == 0
    assert "/system be brief" in (tmp_path / "home" / "history").read_text()

    again = chat()
    again.expect(">>> ")
    again.send(UP + UP + "\r")  # newest first: exit, then /system
    assert "system message set" in again.expect(">>> ")
    again.send("/exit\r")
    assert again.close() == 0


def test_ctrl_c_clears_the_line_and_the_chat_goes_on(chat):
    term = chat()
    term.expect(">>> ")
    term.send("half a thought")
    term.expect("half a thought")
    # Ctrl-C once the line editor waits for keys again: CPython's readline (Modules/readline.c) checks for a
    # signal only when one interrupts its select(), so a SIGINT that lands while it handles a key goes unnoticed
    # until the line ends; a person does not type that fast after the echo
    time.sleep(0.5)
    term.send("\x03")
    term.expect("^C")
    term.expect(">>> ")
    term.send("/help\r")
    assert "/exit" in term.expect(">>> ")  # the chat is still there, and /help lists /exit
    term.send("quit\r")
    assert term.close() == 0
