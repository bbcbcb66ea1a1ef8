"""The wire: everything the parent and its ranks say to each other, and how it travels.

Both sides import it (a rank from the start server's preload), so it imports nothing of the
kit and nothing of torch: messages (every type that crosses, and the protocol's version),
the channel that frames them over a pipe or a socket, the ledger line, and the socket
handshake that a served rank must pass before anything it sends is read.
"""
