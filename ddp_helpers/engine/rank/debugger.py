"""pdb on a rank, driven from the notebook: post-mortem on the frame where the rank's last
failing cell raised, with pdb's input and output carried over the rank's link (the parent
shows each output and reads the next line through the notebook's own input box).

torch.distributed.breakpoint() reads /dev/stdin, which a Jupyter kernel's ranks do not have;
here pdb never touches the rank's stdin: it reads DebugLine commands from the link and sends
DebugOutput replies. `q` (or two empty lines, or anything but a DebugLine, such as the
parent's Stop) ends the session; the rank's namespace and process group stay as they were.
"""

from __future__ import annotations

import io
import pdb

from ..wire.messages import DebugLine, DebugOutput, Ok
from .stacks import CELL_PREFIX

_QUIT = "q\n"


class _Link:
    """pdb's stdin and stdout: what pdb writes is gathered, and sent with the prompt when pdb
    asks for a line; the line comes back as a DebugLine."""

    def __init__(self, link):
        self.link = link
        self.out = io.StringIO()
        self.blank = 0
        self.left: object = None  # a command that ended the session, for the cell server

    def write(self, text: str) -> int:
        return self.out.write(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        text, self.out = self.out.getvalue(), io.StringIO()
        prompt = ""
        if text.endswith(_Pdb.prompt):
            text, prompt = text[:-len(_Pdb.prompt)], _Pdb.prompt
        self.link.send(DebugOutput(text, prompt or _Pdb.prompt))
        try:
            command = self.link.recv()
        except Exception as e:  # noqa: BLE001 - the parent is gone, or sent what we cannot read
            self.left = e
            return _QUIT
        if not isinstance(command, DebugLine):
            self.left = command  # e.g. Stop: end the session, then let the cell server act
            return _QUIT
        line = command.text.strip()
        self.blank = self.blank + 1 if not line else 0
        return _QUIT if self.blank >= 2 else line + "\n"


class _Pdb(pdb.Pdb):
    prompt = "(Pdb) "

    def emptyline(self):
        return None  # pdb repeats the last command; here one empty line does nothing


def post_mortem(link, failure: BaseException | None) -> object:
    """Run pdb on `failure`'s traceback from the cell's frame down, over `link`; reply Ok when
    it ends. Returns a command that arrived in the middle and ended the session (or None)."""
    if failure is None:
        link.send(DebugOutput("", None))
        link.send(Ok())
        return None
    tb = failure.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith(CELL_PREFIX):
        tb = tb.tb_next  # the kit's frames above the cell are not the learner's
    io_ = _Link(link)
    debugger = _Pdb(stdin=io_, stdout=io_, nosigint=True, readrc=False)
    debugger.use_rawinput = False
    if tb is None:  # a SyntaxError: raised before any cell frame ran
        io_.write(f"{type(failure).__name__}: {failure}\n(the cell did not run: nothing to "
                  "inspect)\n")
        link.send(DebugOutput(io_.out.getvalue(), None))
    else:
        io_.write(f"{type(failure).__name__}: {failure}\n")
        debugger.reset()
        debugger.interaction(None, tb)
        link.send(DebugOutput(io_.out.getvalue(), None))
    link.send(Ok())
    return io_.left
