"""Files the trainer did not write itself, and folders it publishes: the floor checkpoint/, hf/ and data/ stand on.

    confine.py        reads confined to a folder: no symlink out of it, no FIFO or device, no file of absurd size
    output_folder.py  where an export or an import writes: a new, empty or earlier output folder, published whole

Each says what is wrong in one line; its callers raise their own error type (CheckpointError, ExportError, DataError).
"""
