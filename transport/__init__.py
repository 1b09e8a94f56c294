"""jaxdist.transport: how bytes move between tasks.

- gRPC: channels (:mod:`~jaxdist.transport.channel`), servers with auth, health
  and metrics (:mod:`~jaxdist.transport.server`), raw-bytes method handlers
  (:mod:`~jaxdist.transport.handlers`).
- :mod:`~jaxdist.transport.admission`: the gRPC server's one gate (auth before
  a call gets a thread, a cap per method, thread lanes), so no caller can
  starve health checks or liveness calls.
- :mod:`~jaxdist.transport.guard`: the one mapping of a handler's exception to
  the status its caller gets, for gRPC and the data plane alike.
- :mod:`~jaxdist.transport.client`: :class:`~jaxdist.transport.client.ServiceClient`,
  the base of every client (token, deadline, typed errors).
- :mod:`~jaxdist.transport.credentials`: the token and TLS material.
- :mod:`~jaxdist.transport.dataplane`: the PS data plane (Pull/Push over plain
  TCP or same-host shared memory).

It may import only :mod:`jaxdist.proto` and :mod:`jaxdist.base.errors`; see the
README's Layout.
"""
