"""Mock engines: GPU-free vLLM/SGLang stand-ins that publish real wire-format KV events and metrics.

`cache` (pure prefix cache), `hashing` (engine block hashes), `publisher` (ZMQ PUB + replay),
`metrics`, `engine` (one engine's HTTP API) and `fleet` (N engines in one loop). Nothing is
imported here, so the pure modules load without the HTTP stack.
"""
