"""The router's state on disk as a log of applied changes plus a compacted image (issue 27).

Each change to what a snapshot holds is appended to a log as it is applied (`state_log`), so the periodic
cost, the disk written and SIGTERM are proportional to what changed; a child process folds the log into a
new image now and then (`compact`), and a start restores the image and replays the log after it (`replay`).
"""
