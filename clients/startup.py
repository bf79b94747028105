"""A starting worker's progress reports to the coordinator (``ReportStartup``).

Before a worker connects it may spend minutes importing, loading the model and building
DeepSpeed's CPU op. :class:`StartupReporter` logs each phase to the worker's own log and sends it
to the coordinator from a background thread, on every change and every ``interval_s`` within a
phase, so the coordinator waits while the worker makes progress and names the slow phase when it
gives up (:mod:`userdp.server.startup`). Reports never block start-up: an unreachable coordinator
(not up yet) is retried at the next tick; one that refuses the caller is left to ``Connect``,
which reports the refusal as the worker's error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import grpc
from userdp.clients.grpc_client import worker_channel
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto import userdp_v1_pb2_grpc as pb_grpc
from userdp.proto.channels import TlsFiles, bearer

log = logging.getLogger("userdp.worker")

REPORT_TIMEOUT_S = 10.0
FINAL_CODES = frozenset(
    {
        grpc.StatusCode.UNIMPLEMENTED,  # a coordinator without start-up reports
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
    }
)


class StartupReporter:
    """Logs and reports this worker's start-up phase (see the module docstring)."""

    def __init__(
        self,
        target: str,
        worker_id: str,
        shards: Sequence[str],
        *,
        token: str | None = None,
        tls: TlsFiles | None = None,
        interval_s: float = 5.0,
    ) -> None:
        self.worker_id = worker_id
        self.shards = list(shards)
        self.interval_s = interval_s
        self._metadata = bearer(token) if token else None
        self._channel = worker_channel(target, tls=tls)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._lock = threading.Lock()
        self._phase = "starting"
        self._since = time.monotonic()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.sent = 0
        log.info("worker %s: starting", worker_id)
        self._thread = threading.Thread(target=self._run, daemon=True, name="userdp-startup")
        self._thread.start()

    @property
    def current(self) -> str:
        return self._phase

    def phase(self, name: str) -> None:
        """Enter phase ``name`` (logged and reported at once); the same name again is a no-op."""
        with self._lock:
            if name == self._phase:
                return
            self._phase, self._since = name, time.monotonic()
        log.info("worker %s: %s", self.worker_id, name)
        self._wake.set()

    def stop(self) -> None:
        """No more reports (the worker is connected: its session shows it is alive); the
        reporting thread ends and closes its channel."""
        self._stop.set()
        self._wake.set()

    def close(self) -> None:
        """Stop reporting; the thread closes the channel once its last call has returned."""
        self.stop()
        self._thread.join(timeout=REPORT_TIMEOUT_S + 1)

    def _report(self) -> bool:
        """Send the current phase; False once reporting is pointless (see FINAL_CODES)."""
        with self._lock:
            phase, seconds = self._phase, time.monotonic() - self._since
        request = pb.StartupReport(
            worker_id=self.worker_id, phase=phase, phase_seconds=seconds, shards=self.shards
        )
        try:
            self._stub.ReportStartup(request, metadata=self._metadata, timeout=REPORT_TIMEOUT_S)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code in FINAL_CODES:
                log.debug("worker %s: start-up reports stopped: %s", self.worker_id, code)
                return False
            return True  # not reachable yet: the next tick tries again
        self.sent += 1
        return True

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._report():
                    return
                self._wake.wait(self.interval_s)
                self._wake.clear()
        finally:
            self._channel.close()
