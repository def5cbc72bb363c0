"""Decoding engine payloads beside the router: the parent's side, the pipe's wire format and the child process."""
