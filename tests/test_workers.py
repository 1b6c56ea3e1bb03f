"""pyhet.workers: the device threads' hand-over, and Ctrl-C (or any handler that raises) at
any moment of a call on a network: the network stays whole and usable, and nothing waits
forever (concurrent.futures' locks, left held by a KeyboardInterrupt, made the next call and
the interpreter's exit wait forever). The runs that interrupt calls at random moments go in
processes of their own, so that a hang ends in their timeout, not the suite's."""

import gc
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from pyhet.workers import EXIT_WAIT_S, Worker


def run(code: str, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The code run in a Python process of its own; its wall time is the result's seconds."""
    try:
        started = time.monotonic()
        # (from a folder outside the source tree, whose pyhet/ has no built core)
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *argv],
                           capture_output=True, text=True, timeout=timeout,
                           cwd=tempfile.gettempdir())
        r.seconds = time.monotonic() - started
        return r
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung: {(e.stdout or b'')[-2000:]!r} {(e.stderr or b'')[-3000:]!r}")


def test_work_runs_in_order_and_gives_its_value_or_its_error():
    with Worker("t") as w:
        seen = []
        works = [w.submit(seen.append, i) for i in range(5)]
        bad = w.submit(lambda: 1 / 0)
        assert [x.result() for x in works] == [None] * 5 and seen == [0, 1, 2, 3, 4]
        assert isinstance(bad.exception(), ZeroDivisionError) and bad.done()
        with pytest.raises(ZeroDivisionError):
            bad.result()
        with pytest.raises(ZeroDivisionError):     # again: the same answer, no wait
            bad.result()
        assert w.submit(pow, 2, 10).result() == 1024
    with pytest.raises(RuntimeError, match="after shutdown"):
        w.submit(pow, 2, 3)


def test_a_callback_runs_once_done_and_at_once_when_done_already():
    gate = threading.Event()
    calls = []
    with Worker("t") as w:
        work = w.submit(gate.wait, 10)
        work.add_done_callback(lambda x: calls.append(("later", threading.current_thread())))
        assert calls == []
        gate.set()
        work.result()
        for _ in range(100):     # the worker runs it right after storing the outcome
            if calls:
                break
            time.sleep(0.01)
        work.add_done_callback(lambda x: calls.append(("now", threading.current_thread())))
    assert [c[0] for c in calls] == ["later", "now"]
    assert calls[0][1] is not threading.current_thread()
    assert calls[1][1] is threading.current_thread()


def test_a_wait_cut_short_by_an_interrupt_can_be_waited_again():
    gate = threading.Event()
    with Worker("t") as w:
        work = w.submit(lambda: gate.wait(10) and "done")
        import signal

        def interrupt():     # a real SIGINT: it cuts the main thread's blocked wait short
            time.sleep(0.05)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        interrupter = threading.Thread(target=interrupt)
        with pytest.raises(KeyboardInterrupt):
            interrupter.start()
            work.result()
        interrupter.join()
        assert not work.done()           # the wait was cut short, not the work
        gate.set()
        assert work.result() == "done"


def test_a_worker_no_longer_held_ends_its_thread():
    w = Worker("pyhet-test-dropped")
    w.submit(pow, 2, 2).result()
    thread = w._thread
    del w
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


@pytest.mark.parametrize("method", ["predict", "fit"])
def test_ctrl_c_at_any_moment_leaves_the_network_whole_and_usable(method):
    """Ctrl-C (Python's own handler, fired by a timer) at 150 random moments of predict or
    fit on two devices: each a KeyboardInterrupt, never another error; the network then
    predicts as before (predict) or trains on (fit), and the process ends."""
    p = run("""
        import random, signal, sys
        import numpy as np, pyhet
        x = np.random.default_rng(0).standard_normal((600, 1, 12, 12)).astype(np.float32)
        y = np.arange(600) % 3
        net = pyhet.Network("4C3-P2-8C3-P2", input_shape=(1, 12, 12), num_classes=3,
                            devices="cpu:1,cpu:1", seed=0)
        want = net.predict(x[:40], batch_size=1)
        signal.signal(signal.SIGALRM, signal.default_int_handler)
        random.seed(1)
        other = []
        for trial in range(150):
            signal.setitimer(signal.ITIMER_REAL, random.uniform(0.001, 0.03))
            try:
                if sys.argv[1] == "predict":
                    net.predict(x, batch_size=1)
                else:
                    net.fit(x, y, steps=1000, batch_size=2)
            except KeyboardInterrupt:
                pass
            except BaseException as e:
                other.append(f"{type(e).__name__}: {e}")
            signal.setitimer(signal.ITIMER_REAL, 0)
        if sys.argv[1] == "predict":
            print(other, bool((net.predict(x[:40], batch_size=1) == want).all()))
        else:
            net.fit(x, y, steps=3, batch_size=2)
            print(other, bool(np.isfinite(net.predict(x[:40])).all()))
        """, method)
    assert p.returncode == 0 and p.stdout == "[] True\n", (p.returncode, p.stdout,
                                                          p.stderr[-3000:])


def test_a_thread_still_training_when_the_main_thread_returns_finishes():
    """concurrent.futures' exit hook stopped the devices' executors before Python joined the
    program's threads: the fit failed with 'cannot schedule new futures after interpreter
    shutdown'."""
    p = run("""
        import threading
        import numpy as np, pyhet
        x = np.random.default_rng(0).standard_normal((64, 1, 12, 12)).astype(np.float32)
        y = np.arange(64) % 3

        def train():
            net = pyhet.Network("4C3-P2-8C3-P2", input_shape=(1, 12, 12), num_classes=3,
                                devices="cpu:1,cpu:1", seed=0)
            net.fit(x, y, steps=60, batch_size=8)
            print("fit done", flush=True)
        threading.Thread(target=train).start()
        print("main returns", flush=True)
        """)
    assert p.returncode == 0 and p.stdout == "main returns\nfit done\n", (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr


def test_any_handler_that_raises_leaves_the_weights_at_a_whole_step():
    """A handler of another signal than SIGINT that raises (a program's timeout) cut a step's
    commit in two: some layers a step ahead of the others (fc.weight after step 4, fc.bias
    after step 3), with no error."""
    p = run("""
        import signal
        import numpy as np, pyhet
        x = np.random.default_rng(0).standard_normal((64, 1, 12, 12)).astype(np.float32)
        y = np.arange(64) % 3

        def make():
            return pyhet.Network("4C3-P2-8C3-P2", input_shape=(1, 12, 12), num_classes=3,
                                 devices="cpu:1", seed=0)
        ref = make()
        steps = [ref.params()]
        ref.fit(x, y, steps=24, batch_size=8, callback=lambda i: steps.append(ref.params()))

        class Timeout(Exception):
            pass

        def on_alarm(s, f):
            raise Timeout()
        signal.signal(signal.SIGALRM, on_alarm)
        torn = []
        for trial in range(240):
            net = make()
            signal.setitimer(signal.ITIMER_REAL, 0.0005 + 0.0001 * trial)
            try:
                net.fit(x, y, steps=24, batch_size=8)
            except Timeout:
                pass
            signal.setitimer(signal.ITIMER_REAL, 0)
            p = net.params()
            at = {n: tuple(k for k, s in enumerate(steps) if np.array_equal(p[n], s[n]))
                  for n in p}
            if len(set(at.values())) > 1:
                torn.append((trial, at))
            net.close()
        print(torn[:2])
        """)
    assert p.returncode == 0 and p.stdout == "[]\n", (p.stdout, p.stderr[-3000:])


def test_every_thread_waiting_on_one_work_gets_its_value():
    """The worker's one release woke one waiter; a second waited forever."""
    gate = threading.Event()
    got = []
    with Worker("t") as w:
        work = w.submit(lambda: gate.wait(10) and 42)
        waiters = [threading.Thread(target=lambda: got.append(work.result())) for _ in range(3)]
        for t in waiters:
            t.start()
        time.sleep(0.1)
        gate.set()
        for t in waiters:
            t.join(10)
    assert got == [42, 42, 42]


def test_a_worker_collected_in_a_cycle_ends_its_thread():
    """The weak reference whose callback ends the thread was the Worker's own: a cycle's
    collection dropped it unheard, and the thread waited for work forever."""
    class Holder:
        pass
    h = Holder()
    h.worker, h.me = Worker("pyhet-test-cycle"), h
    h.worker.submit(pow, 2, 2).result()
    thread = h.worker._thread
    del h
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_a_failing_callback_or_set_up_is_said_and_the_work_goes_on(capsys):
    def bad_set_up():
        raise OSError("no such thing")
    with Worker("pyhet-test-bad", initializer=bad_set_up) as w:
        work = w.submit(pow, 2, 3)
        assert work.result() == 8
        work.add_done_callback(lambda _: 1 / 0)
        assert w.submit(pow, 2, 4).result() == 16
    err = capsys.readouterr().err
    assert "pyhet: pyhet-test-bad's set-up failed:" in err and "OSError: no such thing" in err
    assert "pyhet: an error in a callback of" in err and "ZeroDivisionError" in err


def test_an_exit_while_a_worker_computes_in_the_core_waits_for_it_and_drops_the_rest():
    # a worker that came back from the core's C++ code into a finalizing interpreter aborted the
    # process ("terminate called without an active exception"): a program that ended (an
    # exception, Ctrl-C past its clean-up) with a device never closed. Its finalization made
    # long here (an object whose __del__ sleeps, as a big program's teardown takes time), so
    # that the product ends inside it; the work queued behind it is dropped, not run
    r = run("""
        import sys, time
        import numpy as np
        from pyhet import ops
        from pyhet.workers import Worker

        class SlowTeardown:
            def __del__(self):
                time.sleep(1.5)

        teardown = SlowTeardown()
        a = np.ones((1200, 2400), np.float32)
        b = np.ones((2400, 1600), np.float32)
        w = Worker("pyhet-test-exit")
        started = time.perf_counter()
        w.submit(ops.gemm, a, b, 1).result()
        once = time.perf_counter() - started
        for _ in range(5):       # (the exit reached within 0.5 s or more, on a loaded machine)
            w.submit(ops.gemm, a, b, 1)
        w.submit(lambda: print("queued work ran", flush=True))
        for _ in range(20):
            w.submit(ops.gemm, a, b, 1)
        time.sleep(0.02)
        print(f"exiting {once:.3f}", flush=True)
        sys.exit(3)
    """)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "terminate called" not in r.stderr and "queued work ran" not in r.stdout
    assert r.stdout.startswith("exiting")


def test_an_exit_ends_a_worker_that_waits_on_work_another_dropped():
    """A worker waiting on another's work (a rank's group of devices, calibration's trials):
    the work dropped at the exit ends with an error, so that the waiting one ends too, at
    once, not after the exit's whole wait (EXIT_WAIT_S)."""
    r = run("""
        import sys, time
        from pyhet.workers import Worker
        a, b = Worker("pyhet-test-a"), Worker("pyhet-test-b")
        b.submit(time.sleep, 1.0)
        def waits():
            try:
                b.submit(print, "dropped work ran").result()
            except RuntimeError as e:
                print("woke:", e, flush=True)
        a.submit(waits)
        time.sleep(0.1)
        sys.exit(0)
    """, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dropped work ran" not in r.stdout
    assert "woke: pyhet-test-b: work dropped at the interpreter's exit" in r.stdout, r.stdout
    assert r.seconds < EXIT_WAIT_S / 2, r.seconds


def test_an_exit_with_a_network_finalizer_before_or_after_stops_its_devices_cleanly():
    """Whichever of the two atexit hooks runs first (a program that used weakref.finalize
    before importing pyhet has the Network's run after pyhet's), its devices stop without a
    traceback, and an emulated device's idling is cut short."""
    for first in ("", "import weakref\nclass O: pass\no = O()\nweakref.finalize(o, print)\n"):
        r = run(first + textwrap.dedent("""
            import sys, time
            import numpy as np
            import pyhet
            net = pyhet.Network("4C3-P2", (1, 8, 8), 3, devices="cpu:1,cpu:1@0.01")
            x = np.zeros((64, 1, 8, 8), np.float32)
            net.predict(x)                      # the devices started (and held by the net)
            d = net._devices[1]
            for _ in range(3):                  # each idles 99 times its work
                d.submit("sleep", time.sleep, 0.3)
            time.sleep(0.1)
            print("exiting", flush=True)
        """), timeout=120)
        assert r.returncode == 0 and r.stdout.startswith("exiting"), (first, r.stderr[-2000:])
        assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
        # the whole process: each piece's idling alone would be 30 s
        assert r.seconds < EXIT_WAIT_S / 2, (first, r.seconds)


def test_an_exit_that_waits_in_vain_says_so_and_ends():
    """Work under way past the exit's wait (EXIT_WAIT_S, here made short): a warning line,
    and the process ends all the same."""
    r = run("""
        import sys, time
        import pyhet.workers as W
        W.EXIT_WAIT_S = 0.5
        w = W.Worker("pyhet-test-long")
        w.submit(time.sleep, 30.0)
        time.sleep(0.1)
        sys.exit(0)
    """, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr == ("pyhet: warning: at the interpreter's exit, pyhet-test-long still "
                        "computing after 0.5 s; the process may end abruptly\n"), r.stderr
    assert r.seconds < 15, r.seconds     # not the work's 30 s (about 1 s, start-up included)
