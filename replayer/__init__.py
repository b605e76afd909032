"""PaperDebugger's replayer: open a recording, replay steps, find where NaNs came from.

The Python API a notebook user calls; it reads recordings through ``recorder.store`` and never
imports the TUI.
"""
