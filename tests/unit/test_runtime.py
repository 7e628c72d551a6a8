"""`posttrain.runtime`: process settings of the long-lived processes."""

import gc
import re
import signal
import subprocess
import sys
import textwrap
import weakref

from posttrain.runtime import freeze_setup_objects


class _Node:
    pass


def test_freeze_hides_setup_objects_but_later_cycles_are_collected():
    setup_cycle = _Node()
    setup_cycle.self = setup_cycle
    try:
        freeze_setup_objects()
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the modules, classes and functions imported so far
        assert not any(o is setup_cycle for o in gc.get_objects())  # out of the collector's sight
        later = _Node()
        later.self = later
        ref = weakref.ref(later)
        del later
        gc.collect()
        assert ref() is None  # a cycle made after setup is still collected
    finally:
        gc.unfreeze()


def test_the_supervisor_names_the_signal_that_killed_its_job():
    """A job SIGKILLed (the OOM killer) prints nothing itself: the supervisor must say what
    happened, and exit as the shell reports a killed command."""
    script = textwrap.dedent("""
        import os, signal
        from posttrain.runtime import supervise_in_own_session
        supervise_in_own_session()
        os.kill(os.getpid(), signal.SIGKILL)  # in the job, as the OOM killer would
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL
    assert re.fullmatch(r"posttrain: the job \(pid \d+\) was killed by SIGKILL \(the kernel's OOM killer sends it "
                        r"when memory runs out: see `dmesg`\); checkpoints saved before stay, and the same command "
                        r"resumes from the latest\n", proc.stderr), proc.stderr
