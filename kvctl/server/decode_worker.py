"""The router's decode process: engine payloads in on stdin, decoded batches out on stdout, in order.

Started by `kvctl.server.decoder.ProcessDecoder` as `python -m kvctl.server.decode_worker`; it ends
when its stdin closes. Everything it reads is answered: a payload that does not decode is answered
with its error kind, so the router counts it exactly as it would have in-process.
"""

from __future__ import annotations

import contextlib
import os
import signal

from kvctl.gc_tuning import tune_gc
from kvctl.server.decode_wire import answer, split_requests

_READ = 1 << 20


def serve(fd_in: int, fd_out: int) -> None:
    pending = bytearray()
    while True:
        chunk = os.read(fd_in, _READ)
        if not chunk:
            return
        pending += chunk
        out = b"".join([answer(payload, block_size) for payload, block_size in split_requests(pending)])
        view = memoryview(out)
        while view:
            view = view[os.write(fd_out, view):]


def main() -> None:
    # The router owns the signals: a Ctrl-C in its terminal reaches this process too, and it must
    # keep answering until the router has drained and closes the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tune_gc()
    with contextlib.suppress(BrokenPipeError):  # the router is gone
        serve(0, 1)


if __name__ == "__main__":
    main()
