"""Engine events into the index: one stream per engine's ZMQ endpoint, ordered, replayed after gaps, decoded in the
loop or in a child process (`decode_process`)."""
