"""`kvctl top`: a live Textual dashboard over a router. Only `app`, `widgets` and `screens` import Textual, so
`kvctl top --once` and the frame model load without it."""
