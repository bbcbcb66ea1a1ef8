"""What test_data.py and test_mnist.py share: one offline data folder per test session, a server."""

from __future__ import annotations

import atexit
import functools
import http.server
import shutil
import tempfile
import threading
from pathlib import Path

from ddp_helpers import data


@functools.lru_cache(maxsize=1)
def offline_source() -> data.DataSource:
    """The stand-in digits generated once per session into a temporary data/ folder."""
    root = Path(tempfile.mkdtemp(prefix="ddp-helpers-data-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    source = data.prepare_data(root, download=False, verbose=False)
    assert source.kind == "offline"
    return source


def offline_raw() -> Path:
    """The folder holding the stand-in's MNIST-format files (.gz and extracted)."""
    return Path(offline_source().root) / "OfflineDigits" / "raw"


class MirrorServer:
    """An HTTP server on 127.0.0.1 serving a folder, remembering which paths were asked for."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.requests: list[str] = []
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(folder), **kwargs)

            def do_GET(self):  # noqa: N802 - http.server's naming
                server.requests.append(self.path)
                super().do_GET()

            def log_message(self, *args):  # keep the test output clean
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/mnist/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> MirrorServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
