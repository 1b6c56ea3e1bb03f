from ._command import entry

entry()
