"""The `pyhet` command's first code: loads the command line (pyhet.cli) where Ctrl-C is caught.

Ctrl-C while the package loads is pyhet._loading_interrupted's (one line, status 130); loading
pyhet.cli itself (finding and reading its code) came after that and before pyhet.cli's own
guard, where it gave a traceback.
"""

from . import _is_interrupt, _loading_interrupted


def entry():   # console script, and `python -m pyhet`
    try:
        from .cli import entry as run
    except (KeyboardInterrupt, ImportError) as e:
        if _is_interrupt(e):
            _loading_interrupted()
        raise
    run()
