"""pyhet in a process forked from one where it had run (a multiprocessing.Pool's worker, which
Linux forks by default): OpenMP's threads and a device's worker thread are not copied by
fork(), and work handed to them waited forever. Each case runs in a process of its own, so
that a hang ends in its timeout, not the suite's."""

import subprocess
import sys
import tempfile
import textwrap

import pytest

from pyhet import ops

WARNING = "pyhet runs on one thread here"


def run(code: str, *argv: str) -> subprocess.CompletedProcess:
    try:
        # (from a folder outside the source tree, whose pyhet/ has no built core)
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *argv],
                              capture_output=True, text=True, timeout=120,
                              cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung: {e.stderr!r}")


def test_the_core_in_a_process_forked_after_its_threads():
    """The child's kernels run (on one thread, said once), and give the parent's results."""
    p = run("""
        import os, numpy as np
        from pyhet import ops
        rng = np.random.default_rng(0)
        x = rng.random((8, 4, 19, 19), dtype=np.float32)
        a, b = rng.random((300, 200), dtype=np.float32), rng.random((200, 250), dtype=np.float32)
        want = ops.im2col(x, 3, 3, threads=2), ops.sgemm(a, b, threads=2)
        pid = os.fork()
        if pid == 0:
            got = ops.im2col(x, 3, 3, threads=2), ops.sgemm(a, b, threads=2)
            ops.maxpool(x, 2, threads=2)
            same = np.array_equal(got[0], want[0]) and np.allclose(got[1], want[1], rtol=1e-5)
            os._exit(0 if same else 3)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        """)
    assert p.returncode == 0 and p.stdout == "0\n", (p.stdout, p.stderr)
    assert p.stderr.count(WARNING) == (1 if ops.have_openmp() else 0), p.stderr


@pytest.mark.skipif(not ops.have_openmp(), reason="one thread is all a build without OpenMP has")
def test_the_fork_warning_names_the_programs_line():
    """The warning is the program's: at the line of its call into pyhet (a filter by module
    sees its own code there), not at pyhet's line that called the core."""
    p = run("""
        import os, warnings, numpy as np
        from pyhet import ops
        x = np.ones((2, 3, 9, 9), dtype=np.float32)
        ops.im2col(x, 3, 3, threads=2)
        if os.fork() == 0:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                ops.im2col(x, 3, 3, threads=2)  # the program's line 9
            print([(str(m.category.__name__), m.filename, m.lineno) for m in w], flush=True)
            os._exit(0)
        os.wait()
        """)
    assert p.returncode == 0 and p.stdout == "[('RuntimeWarning', '<string>', 9)]\n", (
        p.stdout, p.stderr)


@pytest.mark.parametrize("devices", ["cpu:2", "cpu:1,cpu:1", "numpy,cpu:1"])
def test_a_network_used_in_a_forked_pool_worker(devices):
    """A Network made in the parent predicts and trains in a Pool's worker as it does in the
    parent (its devices' workers made anew there)."""
    p = run("""
        import multiprocessing as mp, sys
        import numpy as np, pyhet
        net = pyhet.Network("4C5-P2-8C5-P2", input_shape=(3, 20, 20), num_classes=5,
                            devices=sys.argv[1], seed=0)
        x = np.random.default_rng(1).random((6, 3, 20, 20), dtype=np.float32)
        y = np.arange(6) % 5

        def work(_):
            before = net.predict(x)
            net.fit(x, y, steps=3, batch_size=3)
            return before, net.predict(x)

        if __name__ == "__main__":
            want = net.predict(x)
            with mp.get_context("fork").Pool(1) as pool:
                before, after = pool.map(work, [0])[0]
            net.fit(x, y, steps=3, batch_size=3)
            print(np.array_equal(before, want), np.allclose(after, net.predict(x), atol=1e-6))
        """, devices)
    assert p.returncode == 0 and p.stdout == "True True\n", (p.stdout, p.stderr[-3000:])


def test_a_gpu_device_in_a_forked_process_is_refused(monkeypatch):
    """CUDA does not survive fork(): a GPU device made before it is refused with the way out,
    not handed work that never returns."""
    from test_devices import fake_cupy
    from pyhet.devices import make_devices
    from pyhet.errors import DeviceError
    from pyhet.specs import parse_devices
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(count=1))
    gpu, = make_devices(parse_devices("gpu:0"))
    try:
        gpu._pid -= 1          # as in a child: made in another process
        with pytest.raises(DeviceError, match=r"device d0 \(gpu:0\) was made in process .*"
                                              r"\(CUDA does not survive fork\(\).*'spawn'"):
            gpu.call("a test", lambda: None)
    finally:
        gpu._pid += 1
        gpu.close()


def test_a_network_forked_in_the_middle_of_a_call_is_refused_not_waited_on():
    """Forked while another thread was in fit(): the child's lock was held by a thread it
    does not have, and its first call waited forever."""
    p = run("""
        import os, threading, time
        import numpy as np, pyhet
        from pyhet.errors import UsageError
        net = pyhet.Network("4C5-P2", input_shape=(1, 12, 12), num_classes=3,
                            devices="cpu:1")
        x = np.zeros((4, 1, 12, 12), np.float32)
        in_fit = threading.Event()
        go_on = threading.Event()

        def callback(info):
            in_fit.set()
            go_on.wait(60)
        t = threading.Thread(target=net.fit, args=(x, np.zeros(4, int)),
                             kwargs=dict(steps=2, batch_size=2, callback=callback))
        t.start()
        in_fit.wait(60)
        pid = os.fork()
        if pid == 0:
            try:
                net.predict(x)
                os._exit(3)
            except UsageError as e:
                os._exit(0 if "half done" in str(e) else 4)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        go_on.set()
        t.join(60)
        print(status, net.predict(x).shape)
        """)
    assert p.returncode == 0 and p.stdout == "0 (4, 3)\n", (p.stdout, p.stderr[-3000:])


def test_a_network_forked_from_fits_callback_goes_on_in_the_child():
    """Forked by the thread of its own call (in fit's callback, between two steps): it was
    refused as if forked in another thread's call."""
    p = run("""
        import os
        import numpy as np, pyhet
        net = pyhet.Network("4C5-P2", input_shape=(1, 12, 12), num_classes=3,
                            devices="cpu:1")
        x = np.zeros((4, 1, 12, 12), np.float32)
        status = []

        def callback(info):
            if info["step"] != 1:
                return
            pid = os.fork()
            if pid == 0:
                try:
                    ok = net.predict(x).shape == (4, 3)     # allowed in a callback
                except Exception:
                    ok = False
                os._exit(0 if ok else 3)
            status.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        net.fit(x, np.zeros(4, int), steps=2, batch_size=2, callback=callback)
        print(status)
        """)
    assert p.returncode == 0 and p.stdout == "[0]\n", (p.stdout, p.stderr[-3000:])


def test_a_warning_in_a_thread_of_pyhet_alone_names_pyhets_line():
    """In a thread whose every frame is pyhet's (a device's worker), no line is the
    program's: the warning was said at threading.py's; it is at the line in pyhet that said it."""
    import threading
    import warnings
    from pathlib import Path

    import pyhet
    from pyhet import errors

    inside = str(Path(pyhet.__file__).parent / "worker_of_a_test.py")
    space = {"warn": errors.warn}
    exec(compile("def work():\n    warn('slow')\n", inside, "exec"), space)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t = threading.Thread(target=space["work"])
        t.start()
        t.join()
    assert [(m.filename, m.lineno, str(m.message)) for m in w] == [(inside, 2, "slow")]
