"""The fault-injection suite: bad images, bad packs, killed and interrupted processes, bad resume
states and sampler arguments (issue 15). Runs with the rest of the tests (``make test``)."""
