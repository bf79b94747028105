"""A module run under ``python -m userdp.run.tether`` by tests/userdp/test_tether.py: prints its
pid, the parent the tether names for its own children and its arguments; then exits with the
status its first argument gives, or, without arguments, sleeps until it is killed."""

import json
import os
import sys
import time

from userdp.run.tether import PARENT_ENV

said = {"pid": os.getpid(), "parent_env": os.environ.get(PARENT_ENV), "argv": sys.argv[1:]}
print(json.dumps(said), flush=True)
if len(sys.argv) > 1:
    sys.exit(int(sys.argv[1]))
time.sleep(3600)
