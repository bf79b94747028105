"""``userdp worker`` as tests/userdp/test_reduce_kill.py starts it: the collective plane's reduce
cut into one bucket per tensor (:data:`userdp.proto.gloo.BUCKET_ELEMENTS` = 1, as the test sets
it in the coordinator), and the worker named by ``USERDP_TEST_PAUSE_WORKER`` stopping inside the
reduce of step ``USERDP_TEST_PAUSE_STEP`` once the reduces of its first buckets are issued: it
writes the file ``USERDP_TEST_PAUSE_MARKER`` and waits there, so that the test's SIGKILL lands
in the middle of a real gloo reduce. Everything else is the real worker."""

import os
import sys
import time
from pathlib import Path

from userdp.clients.group_plane import WorkerGroup
from userdp.proto import gloo

from userdp.cli import main

BUCKETS_BEFORE_THE_PAUSE = 2
"""Bucket 0's reduce has completed and bucket 1's is in flight when the worker stops."""

gloo.BUCKET_ELEMENTS = 1
if sys.argv[sys.argv.index("--worker-id") + 1] == os.environ["USERDP_TEST_PAUSE_WORKER"]:
    pause_step = int(os.environ["USERDP_TEST_PAUSE_STEP"])
    marker = Path(os.environ["USERDP_TEST_PAUSE_MARKER"])
    reduce, fill = WorkerGroup._reduce, WorkerGroup._fill

    def reduce_counting_buckets(self, message, send):
        self.test_step, self.test_buckets = message.step, 0
        return reduce(self, message, send)

    def fill_pausing_in_the_reduce(self, *args, **kwargs):
        if self.test_step == pause_step and self.test_buckets == BUCKETS_BEFORE_THE_PAUSE:
            marker.write_text(str(os.getpid()))
            time.sleep(3600)  # the test kills the process here
        self.test_buckets += 1
        return fill(self, *args, **kwargs)

    WorkerGroup._reduce = reduce_counting_buckets
    WorkerGroup._fill = fill_pausing_in_the_reduce

sys.exit(main())
