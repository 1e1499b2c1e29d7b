"""TLS to a node that serves it (``server.tls_cert_file``): how the ``tls=`` argument of
:func:`keratin.connect` becomes an :class:`ssl.SSLContext`.

Owns certificate loading only; the connection passes the context to asyncio.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Optional, Tuple, Union

from .errors import TLSError

__all__ = ["TLS", "TLSArg"]


@dataclass
class TLS:
    """TLS settings.

    - ``ca_file``: PEM file of the CA certificates that signed the node's certificate (a
      node's certificate usually comes from the operator's own CA); ``None``: the system's
      trusted roots.
    - ``server_name``: the name to verify the node's certificate for; ``None``: the host of
      the address connected to (an IP address must then be among the certificate's subject
      alternative names).
    - ``cert_file``, ``key_file``: a client certificate chain (the client's certificate
      first) and its key, presented when the node asks for one, as it does for a
      certificate login (``connect(..., external=True)``).
    """

    ca_file: Optional[str] = None
    server_name: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None

    def context(self) -> ssl.SSLContext:
        """The :class:`ssl.SSLContext` these settings describe (TLS 1.2 or later, hostname
        checked)."""
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as e:
            raise TLSError("CA file %s: %s" % (self.ca_file, e)) from e
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if (self.cert_file is None) != (self.key_file is None):
            raise TLSError("a client certificate needs both cert_file and key_file")
        if self.cert_file is not None:
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except (OSError, ssl.SSLError) as e:
                raise TLSError("client certificate %s: %s" % (self.cert_file, e)) from e
        return context


TLSArg = Union[None, bool, ssl.SSLContext, TLS]


def resolve(tls: TLSArg) -> Tuple[Optional[ssl.SSLContext], Optional[str]]:
    """The context and server name for ``tls``: ``None``/``False`` plain TCP, ``True`` the
    system roots, an ``SSLContext`` as given, a :class:`TLS` built."""
    if tls is None or tls is False:
        return None, None
    if tls is True:
        return TLS().context(), None
    if isinstance(tls, ssl.SSLContext):
        return tls, None
    if isinstance(tls, TLS):
        return tls.context(), tls.server_name
    raise TypeError("tls must be None, a bool, an ssl.SSLContext or keratin.TLS, not %r" % (tls,))
