"""The messages between the parent and its ranks: the same commands and replies over a pipe
and over a socket, and a message the receiver cannot rebuild is Unreadable, never a crash."""

import multiprocessing
from multiprocessing.connection import Client, Listener

import pytest

from ddp_helpers.engine.wire.channel import Channel, Unreadable
from ddp_helpers.engine.wire.messages import (
    AskWhere,
    Error,
    Frame,
    Ok,
    Push,
    Ready,
    RunCell,
    Stop,
    Where,
)

MESSAGES = [RunCell(3, "t = 1\nt", ("t",)), Push({"lr": 0.1}), Stop(), AskWhere(),
            Ok(2.0, {"t": 1}), Ready(pid=12, device="cpu", backend="gloo"),
            Error("ValueError", "bad batch", "Traceback ..."),
            Where(in_comm=True, frame=Frame("<cell 3>", 2, "<module>", "dist.barrier()"))]


def pipe_pair():
    a, b = multiprocessing.Pipe(duplex=True)
    return Channel(a), Channel(b)


def socket_pair():
    # What ranks started by torchrun would use: multiprocessing's Connection over TCP.
    with Listener(("127.0.0.1", 0)) as listener:
        client = Client(listener.address)
        server = listener.accept()
    return Channel(client), Channel(server)


@pytest.mark.parametrize("pair", [pipe_pair, socket_pair], ids=["pipe", "socket"])
def test_every_message_arrives_as_sent_over_either_transport(pair):
    sender, receiver = pair()
    try:
        for message in MESSAGES:
            sender.send(message)
            assert receiver.poll(5)
            assert receiver.recv() == message
    finally:
        sender.close()
        receiver.close()


class OnlyHere:
    """Stands for a class a rank defined in a %%ranks cell: the receiver cannot import it."""

    def __reduce__(self):
        return (getattr, ("a str", "no_such_name_anywhere"))


def test_a_message_the_receiver_cannot_rebuild_is_unreadable_and_the_channel_lives_on():
    sender, receiver = pipe_pair()
    sender.send(Ok(OnlyHere()))
    with pytest.raises(Unreadable, match="no_such_name_anywhere"):
        receiver.recv()
    sender.send(Ok(1))
    assert receiver.recv() == Ok(1)


def test_an_error_reply_is_built_from_the_exception_being_handled():
    try:
        raise KeyError("lr")
    except KeyError as e:
        reply = Error.from_exception(e)
    assert (reply.type, reply.message) == ("KeyError", "'lr'")
    assert "raise KeyError" in reply.traceback
    unreadable = Error.unreadable_result(AttributeError("Can't get attribute 'Net'"))
    assert unreadable.type == "UnpicklingError" and "Return plain data" in unreadable.message
