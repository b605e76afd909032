"""PaperDebugger's terminal interface: the ``pdbg`` command line and the Textual app."""
