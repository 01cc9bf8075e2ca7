"""What k3pipe's HTTP clients share: the TLS verification context.

httpx builds a context for every client it makes, reading and parsing the CA bundle each time (about
16 ms of CPU here): a workload's clients, its watch's checks and the health gate's polls made some 80
of them per study. Made once here per trust setting, it is the context httpx itself would have made
(``httpx.create_ssl_context``: SSL_CERT_FILE or SSL_CERT_DIR where the environment is trusted, else
certifi's bundle), and an SSL context may be shared by any number of clients and threads.
"""

from __future__ import annotations

import functools
import os
import ssl

import httpx

__all__ = ["tls"]


def tls(trust_env: bool = True) -> ssl.SSLContext:
    """The verification context of a client made with ``trust_env`` (pass it as ``verify=``)."""
    if not trust_env:
        return _made(False, None, None)
    return _made(True, os.environ.get("SSL_CERT_FILE") or None, os.environ.get("SSL_CERT_DIR") or None)


@functools.lru_cache(maxsize=8)
def _made(trust_env: bool, cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    # the key holds what httpx reads from the environment: a changed variable makes a new context
    return httpx.create_ssl_context(trust_env=trust_env)
