import os
import sys

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

_exit_status = 0


def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


def pytest_unconfigure(config):
    """Leave with pytest's own status once its report is written, skipping the interpreter's
    teardown: Ray's RDT manager keeps a monitor thread (and the transfers queued in a cluster's
    last second) across ray.shutdown(), and that thread calling into Ray's core worker while the
    interpreter tears down once ended a fully passed run with a segmentation fault (exit 139)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
