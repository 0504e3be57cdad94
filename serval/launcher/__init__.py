"""Serval's launcher: ``serval serve`` / ``serval stop`` / ``serval status`` (and ``make serve`` / ``make
stop``) on a Ray cluster, built on Ray's own tools: ``ray start`` for a local head, Ray's
``ServeSubmissionClient`` and Serve's typed status for deploys, psutil for the head's processes.

- ``lifecycle``: start or join a cluster, deploy, wait, report; the foreground server and its teardown.
- ``head``: a local Ray head on loopback and its environment; ``processes``: its processes, by id.
- ``serve_client``: Serve's REST API through Ray's client; ``haproxy``: the HAProxy ingress's drain.
- ``status``: what a deploy needs and waits on (the resource-fit check, the reason it is stuck);
  ``timings``: where the start-up time went; ``report``: the endpoint and a self-check; ``logs``: Serve's
  logs on the terminal; ``kernels``: the native CPU kernels' build in the background on a first start.

Ray reads ``RAY_AUTH_MODE`` once, when a process first asks it about authentication: the launcher's
heads use token authentication unless the caller chose otherwise, and its clients must present the
token, so the default is set here, before any Ray client is made.
"""

import os

os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
