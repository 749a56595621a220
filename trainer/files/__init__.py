"""Files the trainer did not write itself, and the rename that publishes what it writes: leaves that checkpoint/,
hf/, data/ and metrics/ stand on (they import nothing of the trainer: callers raise their own error types).

    confine.py      reads confined to a folder: no symlink out of it, no FIFO or device, no file of absurd size
    json_object.py  a JSON object read as data, every way it is not one a line in the caller's error type
    publish.py      publishing by rename: a folder's entries made durable, the name an earlier folder is moved aside to
"""
