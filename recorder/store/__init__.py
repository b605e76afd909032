"""The store format: layout, writer and reader. The only code that knows how a recording is laid out.

Submodules are imported where used (``recorder.store.reader``), so that importing the recorder does
not import zarr.
"""
