"""Shared settings. Fixtures come from the project's own pytest plugin, `nixl_async.testing`."""

import os

# Keep UCX to loopback on these machines; tests that need real in-flight transfers ask for TCP.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
